"""The deploy gate with and without the coverage bound, on simulated windows (online_sao/gate.py,
"What the window does not cover"; docs/DEPLOY.md, the same paragraph).

Each case is a K-armed "answer" bandit: a rollout is one answer ``k ~ mu`` (the behaviour, here
always the candidate), its reward ``~ Bernoulli(p_k)`` and a version's log-ratio
``log pi(k) - log mu(k)``. Every window is drawn once and decided twice with the deploy defaults
(``DeployConfig``): without a reward range (the gate before the bound) and with the range [0, 1]
(the rewards' real one; ``--reward-range`` for another). Reported per case: the true ``D = V_cand - V_champ``, how often each
decision was taken, and how often the interval held the true ``D`` among the windows not refused.
The cases are those of the audit's two scripts: the support case (a champion with 90% of its mass
where the window samples 1%) and S1-S7.

    .venv/bin/python benchmarks/gate_coverage.py [--windows 3000] [--reward-range 0,1] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import shlex
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from online_sao.config.deploy import DeployConfig  # noqa: E402
from online_sao.gate import GateEvidence, GateSettings, coverage, decide  # noqa: E402

WINDOWS = 3000
"""Windows per case (``--windows``)."""
ROLLOUTS_PER_WINDOW = 40
"""Rollouts in each window (above ``deploy.gate_min_rollouts``, 32)."""
SEED = 0
"""Case ``i`` draws its windows with ``torch.Generator().manual_seed(SEED + i)``."""
SUPPORT_SHAPE_SEED = 1
"""Seed of the random shapes of the support case's versions."""
REWARD_RANGE = (0.0, 1.0)
"""The "after" gate's ``reward_min``, ``reward_max`` (``--reward-range``): the simulated rewards are 0 or 1."""
PROGRESS_EVERY = 1000
"""Print a progress line every this many windows."""
DECISIONS = ("promoted", "rolled_back", "undecided", "refused")
DEFAULT_OUT = Path("benchmarks/results/gate_coverage.md")  # --out


@dataclass
class Case:
    """One simulated pair of versions: behaviour ``mu``, candidate, champion (each a distribution
    over the K answers) and each answer's reward probability."""

    name: str
    mu: torch.Tensor
    candidate: torch.Tensor
    champion: torch.Tensor
    reward_prob: torch.Tensor

    @property
    def true_difference(self) -> float:
        """``V_cand - V_champ`` under the true distributions (a rounding error's -0.0 made 0.0)."""
        return round(float((self.candidate - self.champion) @ self.reward_prob), 12) + 0.0


def simple_case(name: str, mu: list[float], candidate: list[float], champion: list[float],
                reward_prob: list[float]) -> Case:
    """A :class:`Case` from unnormalised weights (each distribution is normalised)."""
    def dist(weights: list[float]) -> torch.Tensor:
        t = torch.tensor(weights, dtype=torch.float64)
        return t / t.sum()
    return Case(name, dist(mu), dist(candidate), dist(champion), torch.tensor(reward_prob, dtype=torch.float64))


def support_case() -> Case:
    """200 answers: mu = candidate puts 99% of its mass on answers 0..99 (reward probability 0.5)
    and 1% on 100..199 (0.95); the champion 10% and 90%. Within each half the mass has a random
    lognormal shape, so a version's ratios on the common answers vary (an LM's never are all equal)."""
    g = torch.Generator().manual_seed(SUPPORT_SHAPE_SEED)
    common, rare = torch.arange(100), torch.arange(100, 200)

    def shaped(parts: list[tuple[torch.Tensor, float]], sigma: float = 0.7) -> torch.Tensor:
        """Each ``(answers, mass)``: that mass spread over those answers with lognormal(0, sigma) shares."""
        out = torch.zeros(200, dtype=torch.float64)
        for idx, mass in parts:
            w = torch.exp(torch.randn(len(idx), generator=g, dtype=torch.float64) * sigma)
            out[idx] = w / w.sum() * mass
        return out

    mu = shaped([(common, 0.99), (rare, 0.01)])
    champion = shaped([(common, 0.10), (rare, 0.90)])
    reward_prob = torch.where(torch.arange(200) < 100, 0.5, 0.95).double()
    return Case("support: champion 90% where the window samples 1%", mu, mu.clone(), champion, reward_prob)


def all_cases() -> list[Case]:
    """The support case, then S1-S7 (K = 10 answers)."""
    half = [0.9] * 5 + [0.1] * 5
    near, far = [3] * 5 + [1] * 5, [20] * 5 + [1] * 5
    return [
        support_case(),
        simple_case("S1 identical versions", [1] * 10, [1] * 10, [1] * 10, [0.5] * 10),
        simple_case("S2 candidate clearly worse, champion mildly off", near[::-1], near[::-1], near, half),
        simple_case("S3 candidate clearly better, champion mildly off", near, near, near[::-1], half),
        simple_case("S4 equal value, champion far off", far, far, far[::-1], [0.5] * 10),
        simple_case("S5 candidate better by ~0.2, champion far off", far, far, far[::-1], [0.6] * 5 + [0.4] * 5),
        simple_case("S6 candidate worse by ~0.2, champion far off", far, far, far[::-1], [0.4] * 5 + [0.6] * 5),
        simple_case("S7 equal value, deterministic rewards, champion far off", far, far, far[::-1],
                    [1, 1, 0, 0, 0.5, 1, 1, 0, 0, 0.5]),
    ]


def arms(reward_range: tuple[float, float]) -> dict[str, tuple[float, float] | None]:
    """Label of each gate -> its reward range (None: the interval is not widened)."""
    return {"before (no reward range)": None, f"after (range [{reward_range[0]:g}, {reward_range[1]:g}])": reward_range}


def parse_range(text: str) -> tuple[float, float]:
    """``LOW,HIGH`` -> ``(LOW, HIGH)``: two finite numbers, LOW below HIGH (an argparse usage error
    otherwise; ``0`` raised an IndexError and ``1,0`` a ValueError, each as a traceback)."""
    wanted = f"wants LOW,HIGH: two finite numbers, LOW below HIGH; got {text!r}"
    try:
        low, high = map(float, text.split(","))  # a ValueError too when there are not two
    except ValueError:
        raise argparse.ArgumentTypeError(wanted) from None
    if not -math.inf < low < high < math.inf:  # NaN fails too
        raise argparse.ArgumentTypeError(wanted)
    return low, high


def gate_settings(reward_range: tuple[float, float] | None) -> GateSettings:
    """The deploy defaults' gate, with ``reward_range`` (or none)."""
    d = DeployConfig()
    low, high = reward_range or (None, None)
    return GateSettings(d.gate_min_rollouts, d.gate_min_ess, d.gate_confidence, d.gate_margin, d.gate_weight_clip,
                        reward_min=low, reward_max=high)


@dataclass
class ArmResult:
    """One gate's decisions on a case's windows."""

    counts: Counter
    covered: int = 0  # windows not refused whose interval held the true D

    def rate(self, decision: str, windows: int) -> str:
        """Share of the ``windows`` that took ``decision``, as a percentage."""
        return f"{100 * self.counts[decision] / windows:.1f}%"

    def interval_coverage(self) -> str:
        """Share of the non-refused windows whose interval held the true D, with their count."""
        decided = sum(self.counts[d] for d in DECISIONS if d != "refused")
        return f"{self.covered / decided:.3f} of {decided}" if decided else "- (all refused)"


def run_case(case: Case, seed: int, windows: int, label: str,
             gates: dict[str, tuple[float, float] | None]) -> tuple[dict[str, ArmResult], float]:
    """Draw ``windows`` windows of the case and decide each with every gate of ``gates`` (:func:`arms`).
    Returns each gate's result and the median of the champion's coverage ``c`` over the windows not
    refused (the same for both gates: the range does not enter a refusal); NaN if all were."""
    g = torch.Generator().manual_seed(seed)
    answers = torch.multinomial(case.mu.expand(windows, -1), ROLLOUTS_PER_WINDOW, replacement=True, generator=g)
    rewards = torch.bernoulli(case.reward_prob[answers], generator=g)
    log_cand = torch.log(case.candidate[answers]) - torch.log(case.mu[answers])
    log_champ = torch.log(case.champion[answers]) - torch.log(case.mu[answers])
    settings = {arm: gate_settings(r) for arm, r in gates.items()}
    results = {arm: ArmResult(Counter()) for arm in gates}
    true_d, champ_cover = case.true_difference, []
    for w in range(windows):
        for arm, s in settings.items():
            ev: GateEvidence = decide(rewards[w], log_cand[w], log_champ[w], s)
            results[arm].counts[ev.decision] += 1
            if ev.decision != "refused":
                results[arm].covered += ev.low <= true_d <= ev.high
        if ev.decision != "refused":
            champ_cover.append(coverage(log_champ[w]))
        if (w + 1) % PROGRESS_EVERY == 0 or w + 1 == windows:
            print(f"  {label}: {w + 1}/{windows} windows", file=sys.stderr, flush=True)
    return results, statistics.median(champ_cover) if champ_cover else math.nan


def case_table(case: Case, results: dict[str, ArmResult], champ_cover: float, windows: int) -> list[str]:
    """The report's section on one case."""
    lines = [f"## {case.name}", "",
             f"True D = {case.true_difference:+.3f}; the champion's coverage c of the window, median over the windows "
             f"not refused: {champ_cover:.3f}.", "",
             "| gate | promoted | rolled back | undecided | refused | interval holds the true D (non-refused) |",
             "|---|---:|---:|---:|---:|---:|"]
    for arm, r in results.items():
        rates = " | ".join(r.rate(d, windows) for d in DECISIONS)
        lines.append(f"| {arm} | {rates} | {r.interval_coverage()} |")
    return lines + [""]


def summary_table(runs: list[tuple[Case, dict[str, ArmResult]]], windows: int) -> list[str]:
    """One line per case: each rate and the interval's coverage, before -> after."""
    lines = ["## Summary (before -> after)", "",
             "| case | true D | promoted | rolled back | undecided | refused | interval holds the true D |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for case, results in runs:
        before, after = results.values()
        cells = [f"{before.rate(d, windows)} -> {after.rate(d, windows)}" for d in DECISIONS]
        held = " -> ".join(r.interval_coverage().split(" of ")[0] for r in (before, after))
        lines.append(f"| {case.name} | {case.true_difference:+.3f} | {' | '.join(cells)} | {held} |")
    return lines + [""]


def header(argv: list[str], windows: int, reward_range: tuple[float, float]) -> list[str]:
    """Title, command, date, machine and what was simulated."""
    d = DeployConfig()
    command = shlex.join([".venv/bin/python", "benchmarks/gate_coverage.py", *argv])
    return [
        "# Deploy gate: the coverage bound on simulated windows", "",
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='minutes')}",
        f"- machine: {platform.platform()}, {os.cpu_count()} logical CPUs, torch {torch.__version__}, "
        f"Python {platform.python_version()}",
        f"- windows: {windows} per case of {ROLLOUTS_PER_WINDOW} rollouts, each drawn once and decided by both gates; "
        f"case i draws with seed {SEED} + i (the support case's version shapes with seed {SUPPORT_SHAPE_SEED})",
        f"- gate: deploy defaults (min_rollouts {d.gate_min_rollouts}, min_ess {d.gate_min_ess:g}, confidence "
        f"{d.gate_confidence:g}, margin {d.gate_margin:g}, weight clip {d.gate_weight_clip}); rewards 0/1; before: no "
        f"reward range (the interval is not widened), after: range [{reward_range[0]:g}, {reward_range[1]:g}]",
        "- the candidate is the behaviour in every case (its coverage is 1); \"interval holds the true D\" is the "
        f"empirical coverage of the {d.gate_confidence:.0%} interval on D, among the windows not refused", "",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=WINDOWS, help="windows per case")
    parser.add_argument("--reward-range", type=parse_range, default=REWARD_RANGE, metavar="LOW,HIGH",
                        help="the after gate's reward range")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="Markdown report")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    cases = all_cases()
    lines, runs, gates = header(argv, args.windows, args.reward_range), [], arms(args.reward_range)
    for i, case in enumerate(cases):
        label = f"case {i + 1}/{len(cases)} ({case.name})"
        print(f"{label}: true D {case.true_difference:+.3f}", file=sys.stderr, flush=True)
        results, champ_cover = run_case(case, SEED + i, args.windows, label, gates)
        lines += case_table(case, results, champ_cover, args.windows)
        runs.append((case, results))
    lines += summary_table(runs, args.windows)
    text = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
