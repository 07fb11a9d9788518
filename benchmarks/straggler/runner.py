"""Run loops of the straggler benchmark in two worker processes and measure them.

The generator and the learner each run in their own spawned process with
``threads`` torch intra-op threads (``torch.set_num_threads`` is process-wide),
started once and reused for every loop; each loop rebuilds the model, critic,
optimisers and engine from the model directory, so loops do not share state.
Both processes start a loop at the same ``time.perf_counter`` instant (the clock
is CLOCK_MONOTONIC on Linux, common to all processes).
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import sys
import time
import traceback
from dataclasses import dataclass

import torch
from transformers.utils.logging import disable_progress_bar

from benchmarks.straggler.channels import Channels
from benchmarks.straggler.generator import run_generator
from benchmarks.straggler.learner import run_learner
from benchmarks.straggler.spec import GeneratorReport, LearnerReport, LoopSpec

ROLES = ("generator", "learner")
GO_LEAD_S = 0.2
"""A loop starts this long after the main process sends the start time, so both
workers have it before it arrives."""
LOOP_TIMEOUT_S = 1800.0
"""Longest wait for a worker's next message (model loading on a loaded machine
included) before the run is declared hung."""
JOIN_TIMEOUT_S = 60.0
"""How long a worker may take to exit after its last loop."""


def overlap(a: float, b: float, lo: float, hi: float) -> float:
    """Length of [a, b] inside [lo, hi]."""
    return max(0.0, min(b, hi) - max(a, lo))


@dataclass
class LoopResult:
    spec: LoopSpec
    generator: GeneratorReport
    learner: LearnerReport

    @property
    def elapsed_s(self) -> float:
        return self.learner.end - self.learner.start

    @property
    def trained(self) -> int:
        return self.learner.trained

    @property
    def rollouts_per_s(self) -> float:
        """Rollouts trained per second of the loop."""
        return self.trained / self.elapsed_s

    def _window(self, a: float, b: float) -> float:
        return overlap(a, b, self.learner.start, self.learner.end)

    @property
    def trained_tokens(self) -> int:
        """Action tokens of the trained rollouts."""
        return sum(sum(s.produced_tokens) for s in self.learner.steps)

    @property
    def trained_tokens_per_s(self) -> float:
        """Action tokens trained per second of the loop. Unlike rollouts/s it does not favour a loop that
        trained its shorter rollouts first (streaming trains rollouts in the order they finish)."""
        return self.trained_tokens / self.elapsed_s

    @property
    def mean_trained_length(self) -> float:
        """Mean action tokens of a trained rollout."""
        return self.trained_tokens / self.trained if self.trained else 0.0

    @property
    def learner_idle_share(self) -> float:
        """Share of the loop the learner was not in a step (collate, SAO step, publish)."""
        busy = sum(self._window(s.start, s.end) for s in self.learner.steps)
        return 1.0 - busy / self.elapsed_s

    @property
    def generator_idle_share(self) -> float:
        """Share of the loop the engine ran no prefill and no decode step (zero sequences decoding)."""
        busy = sum(self._window(s.start, s.end) for s in self.generator.engine_steps if s.kind != "switch")
        return 1.0 - busy / self.elapsed_s

    @property
    def prefill_share(self) -> float:
        """Share of the engine's busy time inside the loop spent in prefills (the engine prefills the
        requests admitted in one round together; streaming mostly admits one at a time)."""
        busy = {kind: sum(self._window(s.start, s.end) for s in self.generator.engine_steps if s.kind == kind)
                for kind in ("prefill", "decode")}
        total = busy["prefill"] + busy["decode"]
        return busy["prefill"] / total if total else 0.0

    @property
    def mean_decode_batch(self) -> float:
        """Sequences per decode step, weighted by the step's time."""
        decode = [(s.batch_size, self._window(s.start, s.end)) for s in self.generator.engine_steps
                  if s.kind == "decode"]
        seconds = sum(t for _, t in decode)
        return sum(b * t for b, t in decode) / seconds if seconds else 0.0

    @property
    def generated_tokens_per_s(self) -> float:
        """Tokens sampled by steps that ended inside the loop (a decode step samples one per sequence)."""
        lo, hi = self.learner.start, self.learner.end
        tokens = sum(s.batch_size for s in self.generator.engine_steps if s.kind != "switch" and lo <= s.end <= hi)
        return tokens / self.elapsed_s

    @property
    def learner_cpu_share(self) -> float:
        """CPU seconds per wall second inside learner steps: 1.0 = a whole core while training."""
        wall = sum(s.end - s.start for s in self.learner.steps)
        return sum(s.cpu_s for s in self.learner.steps) / wall if wall else 0.0

    @property
    def learner_cpu_per_token(self) -> float:
        """CPU seconds of learner steps per trained action token (little affected by other work on the machine)."""
        return sum(s.cpu_s for s in self.learner.steps) / self.trained_tokens if self.trained_tokens else 0.0

    @property
    def generator_cpu_per_token(self) -> float:
        """CPU seconds of the generator process per token its engine sampled over the same span
        (every prefill or decode step samples one token per sequence)."""
        sampled = sum(s.batch_size for s in self.generator.engine_steps if s.kind != "switch")
        return self.generator.cpu_s / sampled if sampled else 0.0

    @property
    def generator_cpu_share(self) -> float:
        """CPU seconds per wall second of the generator process over the loop (all its threads)."""
        return self.generator.cpu_s / self.generator.wall_s if self.generator.wall_s else 0.0

    @property
    def padding_share(self) -> float:
        """Share of the packed positions the learner's forward passes ran on that held no token."""
        slots = sum(s.packed_slots for s in self.learner.steps)
        return 1.0 - sum(s.real_tokens for s in self.learner.steps) / slots if slots else 0.0

    @property
    def padding_share_unpacked(self) -> float:
        """Share of the collated B x T slots that were padding (what a padded learner would run on)."""
        slots = sum(s.padded_slots for s in self.learner.steps)
        return 1.0 - sum(s.real_tokens for s in self.learner.steps) / slots if slots else 0.0

    @property
    def version_lag_mean(self) -> float:
        """Policy versions between sampling and training, mean over trained action tokens."""
        weights = [sum(s.produced_tokens) for s in self.learner.steps]
        total = sum(weights)
        return sum(w * s.version_lag_mean for w, s in zip(weights, self.learner.steps)) / total if total else 0.0

    def timeline(self) -> list[tuple[float, int]]:
        """(seconds since the start, rollouts trained) after each learner step."""
        points, done = [(0.0, 0)], 0
        for s in self.learner.steps:
            done += len(s.indices)
            points.append((s.end - self.learner.start, done))
        return points


def worker(role: str, specs: list[LoopSpec], ch: Channels, threads: int) -> None:
    """Entry of a worker process: run ``role`` for every loop, report each, exit."""
    torch.set_num_threads(threads)
    disable_progress_bar()  # its tqdm lock is a semaphore that os._exit would leave to the resource tracker
    run = run_generator if role == "generator" else run_learner
    code = 0
    try:
        for loop, spec in enumerate(specs):
            ch.results.put(("done", role, loop, run(loop, spec, ch)))
        # what the other worker no longer reads must not hold this process at exit
        (ch.rollouts if role == "generator" else ch.weights).cancel_join_thread()
    except BaseException:
        ch.results.put(("error", role, -1, traceback.format_exc()))
        ch.stop.set()
        code = 1
    ch.results.close()
    ch.results.join_thread()  # every report is in the pipe
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skips the interpreter's teardown of torch and transformers: seconds on a loaded machine


class Mailbox:
    """The workers' messages to the main process. A worker may report ready for the
    next loop before the other is done with this one: such messages wait here."""

    def __init__(self, ch: Channels, procs: dict):
        self.ch, self.procs = ch, procs
        self.early: list[tuple] = []

    def expect(self, kind: str, loop: int) -> dict:
        """The ``kind`` message of loop ``loop`` from each worker, by role."""
        got: dict = {}
        deadline = time.monotonic() + LOOP_TIMEOUT_S
        while len(got) < len(ROLES):
            mine = [m for m in self.early if m[0] == kind and m[2] == loop]
            if mine:
                self.early.remove(mine[0])
                got[mine[0][1]] = mine[0][3]
                continue
            try:
                message = self.ch.results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in self.procs.items() if not p.is_alive() and r not in got]
                if dead:
                    raise RuntimeError(f"the {dead[0]} worker exited (code {self.procs[dead[0]].exitcode}) "
                                       "without reporting")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no {kind} message from the workers within {LOOP_TIMEOUT_S} s")
                continue
            what, role, _, payload = message
            if what == "error":
                raise RuntimeError(f"the {role} worker failed:\n{payload}")
            self.early.append(message)
        return got


def run_loops(specs: list[LoopSpec], threads: int = 1, progress=print) -> list[LoopResult]:
    """Run ``specs`` one after the other in the two workers; a failure in either raises here."""
    ctx = multiprocessing.get_context("spawn")
    ch = Channels.create(ctx)
    procs = {role: ctx.Process(target=worker, args=(role, specs, ch, threads), name=f"straggler-{role}", daemon=True)
             for role in ROLES}
    for proc in procs.values():
        proc.start()
    results, finished, mailbox = [], False, Mailbox(ch, procs)
    try:
        for loop, spec in enumerate(specs):
            mailbox.expect("ready", loop)
            ch.stop.clear()
            start = time.perf_counter() + GO_LEAD_S
            for role in ROLES:
                ch.go(role).put(start)
            reports = mailbox.expect("done", loop)
            result = LoopResult(spec, reports["generator"], reports["learner"])
            progress(f"{spec.mode}: {result.trained} rollouts in {result.elapsed_s:.1f} s = "
                     f"{result.rollouts_per_s:.2f}/s; idle learner {result.learner_idle_share:.0%}, "
                     f"generator {result.generator_idle_share:.0%}")
            results.append(result)
        finished = True
    finally:
        ch.stop.set()
        for proc in procs.values():
            proc.join(timeout=JOIN_TIMEOUT_S if finished else 0.0)  # after a failure a worker may wait on `go`
            if proc.is_alive():
                proc.terminate()
                proc.join()
    return results
