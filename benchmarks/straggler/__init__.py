"""The straggler benchmark's pieces (issue 6): a synchronous generate-then-train loop
against SAO streaming, each as a generator process (TorchEngine) and a learner
process (the SAO step). :mod:`.runner` runs them; ``benchmarks/bench_straggler.py``
is the command line and the report."""
