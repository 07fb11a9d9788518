"""The in-process driver's runs, one after the other or side by side in worker processes.

A run is one (seed, arm) pair: the in-process driver answers its requests one at a time on a
virtual clock with seeded sampling, so each run is reproducible and depends on nothing but
its configuration (and, for an arm with a critic, its seed's value pre-training file). That
makes a multi-seed sweep embarrassingly parallel: with ``experiment.jobs`` above 1 the runs go
to that many spawned worker processes. A seed's value pre-training pass runs first and that
seed's arms start when it is written.

Each worker runs torch on ``serving.torch_threads`` threads, or an equal share of the cores
when that is unset, so the jobs do not oversubscribe the machine. With ``serving.torch_threads``
set, a run uses that many threads in or out of a worker (inprocess.pinned_threads) and the sweep
writes the same results as one after the other (tests/apps/experiments/test_parallel.py,
benchmarks/results/parallel_sweep.md); unset, a worker's share of the cores rounds floats
differently from a run on all of them, and a seed's run drifts apart from its serial twin. A failing run stops the
sweep: runs not yet started are cancelled, those under way finish, and the first error is
raised; ``simulate --resume`` then runs only the runs that did not finish (apps/experiments/resume.py).

A Ctrl-C or a SIGTERM to this process stops the sweep at once: queued runs are cancelled and the
workers are terminated (their runs under way are cut short and left without a summary, so a resume
runs them again), then the KeyboardInterrupt or ``SystemExit(143)`` goes on to the caller. Left
running, the workers went on appending to the results while a ``--resume`` wrote the same files
beside them. Workers ignore SIGINT (a terminal's Ctrl-C reaches the whole process group: the parent
decides) and get SIGTERM when the parent dies (Linux PR_SET_PDEATHSIG), so not even a SIGKILL of
the parent leaves one behind.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path

from apps.config import AppConfig
from apps.experiments.results import ArmSummary, write_summary
from apps.experiments.scenario import results_dir
from apps.experiments.style import StyleClassifier
from apps.stack import exit_on_sigterm

Progress = Callable[[str], None]

WORKER_STOP_S = 10.0
"""A worker asked to stop (SIGTERM) when the sweep is interrupted that is still alive after this is
killed. Workers keep SIGTERM's default action (none of the runs' code catches it), so they end at
once; the bound is for one stuck in a system call."""


def run_arms_inprocess(plan: list[tuple[AppConfig, list[str]]], classifier: StyleClassifier, jobs: int,
                       needs_pretraining: Callable[[AppConfig, list[str]], bool], progress: Progress = print) -> None:
    """For each seed's configuration in ``plan``, the arms named beside it, in process; each arm's
    summary is written beside its results. ``needs_pretraining(run, names)``: whether that seed
    collects value pre-training data first. A seed without arms to run is left alone."""
    if jobs == 1:
        for k, (run, names) in enumerate(plan):
            if not names:
                continue
            pretrain_file = _collect(run, classifier, progress) if needs_pretraining(run, names) else None
            for i, name in enumerate(names, 1):
                progress(f"=== seed {k + 1}/{len(plan)}, arm {i}/{len(names)}: {name} (in process) ===")
                write_summary(results_dir(run), _run_arm(run, name, classifier, pretrain_file, progress))
        return
    _run_side_by_side(plan, classifier, jobs, needs_pretraining, progress)


def _run_side_by_side(plan: list[tuple[AppConfig, list[str]]], classifier: StyleClassifier, jobs: int,
                      needs_pretraining: Callable[[AppConfig, list[str]], bool], progress: Progress) -> None:
    total = sum(len(names) for _, names in plan)
    if not total:
        return
    threads = _threads_per_job(plan[0][0], jobs)
    progress(f"{total} runs over {sum(1 for _, names in plan if names)} seed(s), {jobs} at a time in worker "
             f"processes, {threads} torch thread(s) each")
    # spawn, not fork: a forked child would inherit this process's torch thread pools and locks
    context = multiprocessing.get_context("spawn")
    pending: dict[Future, tuple[str, int, str | None]] = {}
    done_runs = 0
    # A SIGTERM's default action would end this process at once, the workers left running (orphans
    # appending to the results); as SystemExit it unwinds to _stop_workers below.
    previous_sigterm = (signal.signal(signal.SIGTERM, exit_on_sigterm)
                        if threading.current_thread() is threading.main_thread() else None)
    pool = ProcessPoolExecutor(max_workers=min(jobs, total), mp_context=context, initializer=_init_worker,
                               initargs=(os.getpid(),))
    try:
        try:
            def submit_arms(k: int, pretrain_file: Path | None) -> None:
                run, names = plan[k]
                for name in names:
                    future = pool.submit(_arm_job, run, name, classifier, pretrain_file, threads,
                                         _label(k, len(plan), name))
                    pending[future] = ("arm", k, name)

            for k, (run, names) in enumerate(plan):
                if not names:
                    continue
                if needs_pretraining(run, names):
                    future = pool.submit(_pretrain_job, run, classifier, threads, _label(k, len(plan), None))
                    pending[future] = ("pretrain", k, None)
                else:
                    submit_arms(k, None)
            while pending:
                finished, _ = wait(list(pending), return_when=FIRST_COMPLETED)
                for future in finished:
                    kind, k, name = pending.pop(future)
                    try:
                        result = future.result()
                    except BaseException:
                        for other in pending:
                            other.cancel()
                        progress(f"{_label(k, len(plan), name)} failed; the runs under way finish, the rest are "
                                 "cancelled")
                        raise
                    if kind == "pretrain":
                        submit_arms(k, result)
                    else:
                        write_summary(results_dir(plan[k][0]), result)
                        done_runs += 1
                        progress(f"=== {done_runs}/{total} runs done ({_label(k, len(plan), name)}) ===")
        except Exception:
            pool.shutdown(wait=True)  # a run failed: the runs under way finish, the rest were cancelled
            raise
        pool.shutdown(wait=True)
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C or SIGTERM, in the loop or while runs under way finish
        _stop_workers(pool)
        raise
    finally:
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """Stop a pool now: cancel the runs not started, SIGTERM every worker, wait for them (together,
    WORKER_STOP_S at most) and SIGKILL any left. The pool's own shutdown only waits for the runs
    under way, which take minutes. The workers are the pool's ``_processes`` (what Python 3.14's
    ``terminate_workers`` reads; 3.11 has no public way to them), taken before ``shutdown`` clears it."""
    workers = list((pool._processes or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
    deadline = time.monotonic() + WORKER_STOP_S
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
    for worker in workers:
        if worker.is_alive():
            worker.kill()
            worker.join()



def _init_worker(parent_pid: int) -> None:
    """A worker's setup before its first job: SIGTERM when the parent dies (the parent death signal,
    kept for the life of the worker), and Ctrl-C left to the parent, which stops the workers itself
    (a worker's KeyboardInterrupt would end its job as a failed run, or end an idle worker and
    break the pool). A parent that died before the signal was set is caught by its pid."""
    from streams.broker import _parent_death_signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_parent_death_signal = _parent_death_signal()
    if set_parent_death_signal is not None:
        set_parent_death_signal()
    if os.getppid() != parent_pid:
        os._exit(1)


def _threads_per_job(cfg: AppConfig, jobs: int) -> int:
    """Torch threads for each worker: the configured engine threads, else an equal share of the cores."""
    if cfg.serving.torch_threads is not None:
        return cfg.serving.torch_threads
    return max(1, (os.cpu_count() or 1) // jobs)


def _label(k: int, seeds: int, arm: str | None) -> str:
    return f"[seed {k + 1}/{seeds} {arm or 'value pre-training data'}]"


def _collect(run: AppConfig, classifier: StyleClassifier, progress: Progress) -> Path:
    from apps.experiments.inprocess import collect_pretrain_inprocess

    return collect_pretrain_inprocess(run, classifier, progress)


def _run_arm(run: AppConfig, name: str, classifier: StyleClassifier, pretrain_file: Path | None,
             progress: Progress) -> ArmSummary:
    from apps.experiments.inprocess import run_arm_inprocess

    return run_arm_inprocess(run, name, classifier, results_dir(run), progress, pretrain_file)


def _in_worker(threads: int, label: str) -> Progress:
    """Set up a worker process for one job; its progress lines carry the job's label."""
    import torch

    torch.set_num_threads(threads)
    return lambda line: print(f"{label} {line}", flush=True)


def _pretrain_job(run: AppConfig, classifier: StyleClassifier, threads: int, label: str) -> Path:
    return _collect(run, classifier, _in_worker(threads, label))


def _arm_job(run: AppConfig, name: str, classifier: StyleClassifier, pretrain_file: Path | None, threads: int,
             label: str) -> ArmSummary:
    return _run_arm(run, name, classifier, pretrain_file, _in_worker(threads, label))
