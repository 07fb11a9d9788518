"""Why an arm does or does not re-align: diagnostics of a drift run's results directory.

Reads what ``online-sao simulate`` wrote (one seed, or ``seed-<k>/`` directories) and prints
Markdown tables, each cell the mean over seeds with its 95% bootstrap interval:

* the share of each phase's preferred style among the arm's *sampled* answers (the judge's
  classifier's style of every rollout): in the ``BEFORE`` rollouts before the phase starts
  (is the next style still being sampled?), in the phase's first quarter and in its last
  quarter;
* per phase, the median over the learner's steps (in-process driver: ``StepRow`` metrics) of
  the critic's explained variance before the step's updates, the approximate KL of the
  step's policy update and the policy gradient norm; the median of each seed first, then
  the mean over seeds;
* per phase, the critic against a running mean as a predictor of the reward: the critic's
  squared error (the mean over the phase's steps of ``value_loss``, before the step's updates:
  token-mean ``(V_t - G_t)^2`` with ``G_t`` the answer's reward, as ``gamma`` and
  ``lambda_critic`` are 1) beside the squared error of the mean of the ``RUNNING_WINDOW`` rewards
  delivered before each of the phase's delivered rewards, in judging order (the
  running_mean_w128 baseline's prediction), and their ratio per seed (below 1: the critic
  predicts better than the running mean, and its advantages can carry more than the mean's);
  the per-step explained variance above is on a step's four or so rollouts, where one rollout
  more or less swings it, so this is the pooled view;
* with raters who rate on scales of their own (``experiment.rater_scale`` / ``rater_offset``), the
  same running mean taken over the rewards of the same raters only, against the running mean of all: how much
  of the reward's error a baseline that knows who rates could remove;
* value pre-training's held-out explained variance (the arm summaries);
* the drift detector's restarts (steps with ``drift_alarm``): per seed the rollouts at which
  they came, restarts before the first switch (false alarms), and each switch's detection
  delay (rollouts from the switch to the first restart after it, before the next switch);
  for each restart inside a phase, what fell before it: the reward, the judge's quality, or the
  share of answers in the preferred style (a quality drop with the style kept is the learner's
  own answers getting worse, not the users changing).

    .venv/bin/python benchmarks/drift_diagnostics.py RESULTS_DIR
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections import defaultdict, deque
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from apps.experiments.aggregate import Run, arm_names, load_runs  # noqa: E402
from apps.experiments.intervals import cell, interval  # noqa: E402
from apps.experiments.results import ArmResults, RewardRow, StepRow  # noqa: E402

BEFORE = 50
"""Rollouts before a switch over which the next style's share is measured: a third of drift.yaml's phase."""
STEP_METRICS = ("explained_variance", "value_loss", "critic_fit_loss", "shrinkage_alpha", "approx_kl",
                "policy_grad_norm")
"""value_loss: the critic's squared error on the step's new answers before its updates;
critic_fit_loss: on the data its first update fits (the step's answers under judge_then_fit, the
replay window under replay_then_judge), so the two apart show how the critic generalises to the
answers it judges; shrinkage_alpha: with value_shrinkage_window (absent otherwise, row left out)."""
RUNNING_WINDOW = 128
"""Rewards in the running mean the critic is compared with (the running_mean_w128 arm's W)."""
CRITIC_ROWS = (
    ("value_loss", ((0, "critic squared error"), (1, "running-mean squared error"), (2, "ratio critic / mean"))),
    ("value_loss_adjusted", ((0, "adjusted values' squared error"), (2, "ratio adjusted / mean"))),
    ("value_loss_first", ((0, "critic squared error, first answer token"), (2, "ratio first token / mean"))),
    ("value_loss_last", ((0, "critic squared error, last answer token"), (2, "ratio last token / mean"))),
)
"""Rows of the critic-against-the-running-mean table: the critic's own values, then (with
``value_shrinkage_window`` or ``value_level_window``) the values the advantages took, then the
critic's at each answer's first token (from the prompt alone) and its last (having read the
whole answer): what it reads from the answer, which token-level credit needs."""


def share_of(styles: Sequence[str | None], style: str) -> float | None:
    """Share of ``styles`` equal to ``style``; None for no rollouts."""
    return sum(s == style for s in styles) / len(styles) if styles else None


def phase_windows(start: int, end: int, first: bool) -> list[tuple[str, int, int]]:
    """(label, from, to) of the measured windows of the phase ``[start, end)``."""
    quarter = max(1, (end - start) // 4)
    windows = [] if first else [(f"{BEFORE} before", max(0, start - BEFORE), start)]
    return windows + [("first quarter", start, start + quarter), ("last quarter", end - quarter, end)]


def phase_values(steps: Sequence[StepRow], key: str, start: int, end: int) -> list[float]:
    """The finite values of a step metric over the steps taken while rollouts ``[start, end)`` were judged.
    A step's ``rollout`` is how many rollouts were judged when it ran, so its newest is ``rollout - 1``:
    the steps with ``start < rollout <= end``."""
    return [s.metrics[key] for s in steps if start < s.rollout <= end and key in s.metrics
            and math.isfinite(s.metrics[key])]


def step_median(steps: Sequence[StepRow], key: str, start: int, end: int) -> float | None:
    """Median of a step metric over the steps taken while rollouts ``[start, end)`` were judged."""
    values = phase_values(steps, key, start, end)
    return statistics.median(values) if values else None


def critic_squared_error(steps: Sequence[StepRow], start: int, end: int, key: str = "value_loss") -> float | None:
    """Mean ``key`` (``value_loss``: the critic's, before the step's updates;
    ``value_loss_adjusted``: of the values the advantages took, shrunk or levelled) over the steps
    taken while rollouts ``[start, end)`` were judged; None without any."""
    values = phase_values(steps, key, start, end)
    return statistics.fmean(values) if values else None


def running_mean_squared_error(rewards: Sequence[RewardRow], start: int, end: int,
                               window: int = RUNNING_WINDOW, by_rater: bool = False) -> float | None:
    """Mean over the delivered rewards of rollouts ``[start, end)`` of ``(r - m)^2``, ``m`` the mean of
    the ``window`` delivered rewards before it in judging order (from the arm's first; a reward with
    none before it is left out). None when no reward is left. ``by_rater``: ``m`` over the rewards of
    the same raters only (the same ``RewardRow.rater_scale`` and ``rater_offset``): a baseline that knows who rates, the
    most a per-prompt baseline could take from the raters' scales."""
    recent: dict[tuple[float, float] | None, deque[float]] = defaultdict(lambda: deque(maxlen=window))
    errors = []
    for row in rewards:
        if not row.delivered:
            continue
        peers = recent[_raters(row) if by_rater else None]
        if start <= row.rollout < end and peers:
            errors.append((row.reward - statistics.fmean(peers)) ** 2)
        peers.append(row.reward)
    return statistics.fmean(errors) if errors else None


def _raters(row: RewardRow) -> tuple[float, float]:
    return row.rater_scale, row.rater_offset


def critic_vs_running_mean(arm: ArmResults, start: int, end: int,
                           key: str = "value_loss") -> tuple[float, float, float] | None:
    """(critic's squared error, running mean's, their ratio) over phase ``[start, end)``, the
    critic's from step metric ``key`` (:func:`critic_squared_error`); None when the arm has no
    such steps or no rewards there."""
    critic = critic_squared_error(arm.steps, start, end, key)
    mean = running_mean_squared_error(arm.rewards, start, end)
    if critic is None or mean is None or mean == 0:
        return None
    return critic, mean, critic / mean


def restarts(steps: Sequence[StepRow]) -> list[int]:
    """Rollout index of every step that restarted the learner after a drift alarm (a roll-back,
    ``drift.rollback_first``, is not a restart)."""
    return [s.rollout for s in steps if s.metrics.get("drift_alarm", 0.0) > 0 and not _rolled_back(s)]


def _rolled_back(step: StepRow) -> bool:
    return step.metrics.get("drift_rollback", 0.0) > 0


def rollbacks(steps: Sequence[StepRow]) -> list[tuple[int, str]]:
    """Each roll-back's rollout index and how its probation ended: "held" (no restart),
    "restarted" (the probation's test or the detector fired first), or "open" (the run ended)."""
    found = []
    for i, step in enumerate(steps):
        if not _rolled_back(step):
            continue
        outcome = "open"
        for later in steps[i + 1:]:
            if later.metrics.get("drift_alarm", 0.0) > 0:  # a probation always ends in a restart
                outcome = "restarted"
                break
            if _ends_probation(later):
                outcome = "held"
                break
        found.append((step.rollout, outcome))
    return found


def _ends_probation(step: StepRow) -> bool:
    return not math.isnan(step.metrics.get("drift_probation_z", math.nan))


CONTEXT_RECENT, CONTEXT_REFERENCE = 16, 48
"""Rollouts before a restart read as the detector's two windows (drift.recent, drift.reference
defaults): what the answers were like in the reference window and in the recent one."""
SWITCH_HORIZON = 60
"""A restart more than this many rollouts after the last switch is "inside a phase": the longest
detection delay seen after a switch in the replay calibration was 47 (docs/EXPERIMENTS.md section 10)."""


def window_means(rewards: Sequence[RewardRow], start: int, end: int) -> tuple[float, float, float] | None:
    """Delivered rollouts in ``[start, end)`` -> (mean reward, mean quality, share of answers in
    the style preferred at the time); None when there are none."""
    rows = [r for r in rewards if r.delivered and start <= r.rollout < end]
    if not rows:
        return None
    n = len(rows)
    return (sum(r.reward for r in rows) / n, sum(r.quality for r in rows) / n,
            sum(r.sampled_style == r.preferred for r in rows) / n)


def restart_context(rewards: Sequence[RewardRow], at: int) -> tuple[tuple[float, float, float], ...] | None:
    """:func:`window_means` of the reference window and of the recent window that end where the restart
    came, after ``at`` rollouts were judged (rollout ``at`` itself was judged after it); None when either
    is empty."""
    end = at
    before = window_means(rewards, end - CONTEXT_RECENT - CONTEXT_REFERENCE, end - CONTEXT_RECENT)
    recent = window_means(rewards, end - CONTEXT_RECENT, end)
    return None if before is None or recent is None else (before, recent)


def detection_delay(alarms: Sequence[int], start: int, end: int) -> int | None:
    """Rollouts from a switch at ``start`` to the first restart in ``(start, end]``; None: none. A restart
    is logged with the rollouts judged before it: one at ``start`` saw none of the new phase's (it counted
    as a delay of 0), one at ``end`` saw this phase's last."""
    return next((a - start for a in alarms if start < a <= end), None)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _over_seeds(values: list[float | None]) -> str:
    """Mean and interval over the seeds with a value, with how many of them when some have none."""
    return cell(interval([v for v in values if v is not None]), of=len(values))


def report(runs: list[Run]) -> str:
    scenario = runs[0].scenario
    starts = [p.from_rollout for p in scenario.schedule] + [scenario.rollouts_per_arm]
    arms = arm_names(runs, scenario)
    phases = [(p.style, starts[k], starts[k + 1], k == 0) for k, p in enumerate(scenario.schedule)]
    windows = [(style, label, a, b) for style, s, e, first in phases for label, a, b in phase_windows(s, e, first)]
    head = ["arm", *(f"{style}: {label} ({a}-{b - 1})" for style, label, a, b in windows)]
    lines = [f"Seeds: {len(runs)}. Each cell: mean over seeds [95% bootstrap interval].", "",
             "Share of the phase's preferred style among sampled answers", "", _row(head),
             "|" + "---|" * len(head)]
    for arm in arms:
        present = [run for run in runs if arm in run.arms]
        lines.append(_row([arm, *(_over_seeds([share_of([r.sampled_style for r in run.arms[arm].rewards[a:b]], style)
                                               for run in present]) for style, _, a, b in windows)]))
    head = ["arm", "measure", *(f"{style} ({s}-{e - 1})" for style, s, e, _ in phases)]
    lines += ["", "Learner steps: per-seed median over the phase's steps, mean over seeds", "", _row(head),
              "|" + "---|" * len(head)]
    for arm in arms:
        present = [run.arms[arm] for run in runs if arm in run.arms]
        for key in STEP_METRICS:
            cells = [_over_seeds([step_median(a.steps, key, s, e) for a in present]) for _, s, e, _ in phases]
            if any(c != "-" for c in cells):
                lines.append(_row([arm, key, *cells]))
    head = ["arm", "restarts at rollout (per seed)", "before the first switch",
            *(f"delay after the switch to {style}" for style, _, _, first in phases if not first)]
    lines += ["", "Drift restarts (seeds in order; a delay is the mean over the seeds with a restart in that "
              "phase, how many in parentheses)", "", _row(head), "|" + "---|" * len(head)]
    for arm in arms:
        alarms = [restarts(run.arms[arm].steps) for run in runs if arm in run.arms]
        delays = []
        for _, s, e, first in phases:
            if not first:
                found = [d for d in (detection_delay(a, s, e) for a in alarms) if d is not None]
                delays.append(f"{statistics.mean(found):.1f} ({len(found)}/{len(alarms)})" if found
                              else f"- (0/{len(alarms)})")
        early = sum(1 for a in alarms for x in a if x <= phases[1][1]) if len(phases) > 1 else 0
        lines.append(_row([arm, "; ".join(",".join(map(str, a)) or "none" for a in alarms), str(early), *delays]))
    backs = {arm: [rollbacks(run.arms[arm].steps) for run in runs if arm in run.arms] for arm in arms}
    if any(b for seeds in backs.values() for b in seeds):
        lines += ["", "Drift roll-backs (`drift.rollback_first`; seeds in order: the rollout, then how the "
                  "probation ended: held, restarted, or open)", "", _row(["arm", "roll-backs (per seed)"]), "|---|---|"]
        for arm in arms:
            lines.append(_row([arm, "; ".join(",".join(f"{at} {how}" for at, how in b) or "none" for b in backs[arm])]))
    lines += ["", f"Restarts inside a phase (more than {SWITCH_HORIZON} rollouts after the last switch): the "
              f"delivered answers' mean reward, quality and share in the preferred style, {CONTEXT_REFERENCE} "
              f"rollouts before the last {CONTEXT_RECENT} -> those {CONTEXT_RECENT}", "",
              _row(["arm", "seed", "rollout", "reward", "quality", "preferred-style share"]), "|---|---|---|---|---|---|"]
    for arm in arms:
        for run in runs:
            if arm not in run.arms:
                continue
            for at in restarts(run.arms[arm].steps):
                switch = max(s for _, s, _, _ in phases if s < at)
                if switch > 0 and at - switch <= SWITCH_HORIZON:
                    continue
                context = restart_context(run.arms[arm].rewards, at)
                if context is not None:
                    (b_r, b_q, b_s), (r_r, r_q, r_s) = context
                    lines.append(_row([arm, str(run.scenario.seed), str(at), f"{b_r:.2f} -> {r_r:.2f}", f"{b_q:.2f} -> {r_q:.2f}",
                                       f"{b_s:.2f} -> {r_s:.2f}"]))
    head = ["arm", "measure", *(f"{style} ({s}-{e - 1})" for style, s, e, _ in phases)]
    lines += ["", f"The critic against a running mean of {RUNNING_WINDOW} rewards as a predictor of the reward "
              "(squared errors per phase, mean over seeds; the critic's a mean over answer tokens before each "
              "step's updates, the running mean's over delivered rewards; the ratio is per seed: below 1 the "
              "critic predicts better)",
              "", _row(head), "|" + "---|" * len(head)]
    for arm in arms:
        present = [run.arms[arm] for run in runs if arm in run.arms]
        for key, labels in CRITIC_ROWS:
            found = [[critic_vs_running_mean(a, s, e, key) for a in present] for _, s, e, _ in phases]
            if not any(f is not None for cells in found for f in cells):
                continue
            for index, label in labels:
                lines.append(_row([arm, label, *(_over_seeds([None if f is None else f[index] for f in cells])
                                                 for cells in found)]))
    if any(_raters(row) != (1.0, 0.0) for run in runs for a in run.arms.values() for row in a.rewards):
        lines += ["", f"Raters with scales of their own: a running mean of the last {RUNNING_WINDOW} rewards of "
                  "the same raters (a baseline that knows who rates) against the running mean of all "
                  "(squared errors per phase; the ratio per seed)", "", _row(head), "|" + "---|" * len(head)]
        for arm in arms:
            present = [run.arms[arm] for run in runs if arm in run.arms]
            pairs = [[(running_mean_squared_error(a.rewards, s, e, by_rater=True),
                       running_mean_squared_error(a.rewards, s, e)) for a in present] for _, s, e, _ in phases]
            lines.append(_row([arm, "per-rater mean squared error",
                               *(_over_seeds([g for g, _ in cells]) for cells in pairs)]))
            lines.append(_row([arm, "ratio per-rater / mean",
                               *(_over_seeds([g / m if g is not None and m else None for g, m in cells])
                                 for cells in pairs)]))
    lines += ["", "Value pre-training: held-out explained variance after it", ""]
    for arm in arms:
        pre = [run.arms[arm].summary.value_pretraining for run in runs
               if arm in run.arms and run.arms[arm].summary and run.arms[arm].summary.value_pretraining]
        if pre:
            after = [p["ev_after"] for p in pre if "ev_after" in p]
            lines.append(f"- {arm}: {_over_seeds(after)} in the {len(after)} of {len(pre)} seeds that kept a "
                         f"pre-trained critic (the others: no epoch improved the held-out loss)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results_dir", type=Path)
    args = parser.parse_args(argv)
    print(report(load_runs(args.results_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
