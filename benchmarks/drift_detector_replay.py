"""Calibrating the drift detector on logged runs: replay each arm's delivered rewards, in
rollout order, through :class:`online_sao.drift.RewardDropDetector` under candidate settings.

Use it on runs made *without* restarts (``drift.enabled: false``), whose reward streams the
detector did not change: alarms before the first switch are false alarms; the first alarm
after a switch (before the next one) gives the detection delay; a switch with no alarm before
the next switch (or within ``--horizon`` rollouts) is missed. Missed switches include those
with nothing to detect (an arm whose reward was already low before the switch).

    .venv/bin/python benchmarks/drift_detector_replay.py RESULTS_DIR [RESULTS_DIR ...] \\
        --settings 16,48,0.2,3.0 --settings 16,48,0.25,4.0      # recent,reference,min_drop,z
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from apps.experiments.aggregate import load_runs  # noqa: E402
from online_sao.drift import DriftSettings, RewardDropDetector  # noqa: E402


@dataclass
class Replay:
    """What one setting did over every replayed stream."""

    streams: int = 0
    first_phase_rewards: int = 0
    false_alarms: int = 0
    switches: int = 0
    missed: int = 0
    delays: list[int] | None = None


def alarms_of(rewards: list[float], settings: DriftSettings) -> list[int]:
    """Indices (into ``rewards``) at which the detector alarms."""
    detector = RewardDropDetector(settings)
    return [i for i, r in enumerate(rewards) if detector.observe([r])[0]]


def replay(streams: list[tuple[list[float], list[int]]], settings: DriftSettings, horizon: int) -> Replay:
    """``streams``: (delivered rewards in rollout order, indices at which the preference switched)."""
    out = Replay(delays=[])
    for rewards, switches in streams:
        alarms = alarms_of(rewards, settings)
        first = switches[0] if switches else len(rewards)
        out.streams += 1
        out.first_phase_rewards += first
        out.false_alarms += sum(a < first for a in alarms)
        for k, start in enumerate(switches):
            end = min(switches[k + 1] if k + 1 < len(switches) else len(rewards), start + horizon)
            found = [a - start for a in alarms if start <= a < end]
            out.switches += 1
            if found:
                out.delays.append(found[0])
            else:
                out.missed += 1
    return out


def streams_of(results_dirs: list[Path]) -> list[tuple[list[float], list[int]]]:
    streams = []
    for results_dir in results_dirs:
        for run in load_runs(results_dir):
            for arm in run.arms.values():
                rows = sorted((r for r in arm.rewards if r.delivered), key=lambda r: r.rollout)
                rewards = [r.reward for r in rows]
                switches = [i for i in range(1, len(rows)) if rows[i].preferred != rows[i - 1].preferred]
                streams.append((rewards, switches))
    return streams


def parse_settings(text: str) -> DriftSettings:
    recent, reference, min_drop, z = text.split(",")
    return DriftSettings(int(recent), int(reference), float(min_drop), float(z))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results_dirs", type=Path, nargs="+")
    parser.add_argument("--settings", type=parse_settings, action="append", required=True,
                        help="recent,reference,min_drop,z_threshold (repeatable)")
    parser.add_argument("--horizon", type=int, default=100, help="a switch not detected within this many rollouts is missed")
    args = parser.parse_args(argv)
    streams = streams_of(args.results_dirs)
    print("| recent | reference | min_drop | z | streams | false alarms (first-phase rewards) | switches | missed | "
          "delay median [min, max] |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in args.settings:
        r = replay(streams, s, args.horizon)
        delay = (f"{statistics.median(r.delays):.0f} [{min(r.delays)}, {max(r.delays)}]" if r.delays else "-")
        print(f"| {s.recent} | {s.reference} | {s.min_drop} | {s.z_threshold} | {r.streams} | "
              f"{r.false_alarms} ({r.first_phase_rewards}) | {r.switches} | {r.missed} | {delay} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
