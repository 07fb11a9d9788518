"""The registry's decisions in the drift report: per arm, what the promotion gate and the
monitors decided on each candidate over the run, read from MLflow, as a table and as ticks on
a reward-over-time plot (docs/DEPLOY.md, "Reading the evidence in MLflow").

A live arm's learner registers every ``mlflow.register_every``-th published version as the
candidate and decides on it when it publishes the next multiple, ``register_every`` versions
later (trainer/releases.py); a restart after a detected preference change is registered and made
champion when it is published. The arm's resolved configuration
(``<run>/arms/<arm>/config.yaml``) names the MLflow store, the registered model and the
learner's consumer group, which together identify the arm's learner run (each seed's run of an
arm has a registered model of its own: orchestrate.seed_config); the registry versions that run
created are the arm's. Arms of the in-process driver have no registry and are left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure

from apps.config import AppConfig, load_app_config
from apps.experiments.aggregate import Run, moving_reward_band
from apps.experiments.orchestrate import learner_run
from apps.experiments.plots import mark_switches
from apps.experiments.results import RewardRow

GATE_PNG = "registry_decisions.png"
DECISION_COLOURS = {"promoted": "tab:green", "rolled back": "tab:red", "kept": "tab:grey", "refused": "tab:orange"}
"""Tick colour of each decision on the plot."""


@dataclass(frozen=True)
class RegistryDecision:
    """One decided candidate of an arm's learner, with the gate's and the monitors' evidence."""

    registry_version: str
    policy_version: int
    decided_at_version: int
    """The published version whose release decided (candidate + ``register_every``)."""
    decision: str
    """promoted, rolled back, kept (the gate could not tell) or refused (too little evidence)."""
    gate: str
    """The gate's own verdict (``gate.decision``): no_champion for the first candidate; "on record"
    added when the champion could not be scored and its record stood in (``gate.basis``)."""
    reason: str
    candidate_value: float
    champion_value: float
    low: float
    high: float
    candidate_ess: float
    champion_ess: float
    tripped: str
    """Monitors over their thresholds, comma-separated ("none")."""
    canary_n: int | None = None
    """The champion's own answers the gate used (``gate.canary_n``; None: no such tag)."""
    rollout: int | None = None
    """First judged rollout answered by ``decided_at_version`` or newer (None: not in the results)."""
    seconds: float | None = None
    """That rollout's judging time from the arm's first judged rollout."""
    quality: float = math.nan
    """The quality monitor's reading on the candidate's answers (``monitor.score_quality``: the
    judge's mean answer quality; NaN when the rewards carried none)."""


DRIFT_CHANGES = ("drift_restart", "drift_rollback")
"""``gate.decision`` of versions the learner published as champion at once after a detected reward
drop: a restart or a roll-back (trainer/releases.py, Releases.rebase)."""


def _number(tags: dict[str, str], key: str) -> float:
    return float(tags[key]) if key in tags else math.nan


def _label(tags: dict[str, str]) -> str:
    if tags["decision"] == "promoted":
        return "promoted"
    if tags["decision"] == "rolled_back":
        return "rolled back"
    return "refused" if tags.get("gate.decision") == "refused" else "kept"


def _gate(tags: dict[str, str]) -> str:
    on_record = " on record" if tags.get("gate.basis") == "record" else ""
    return tags.get("gate.decision", "-") + on_record


def read_decisions(acfg: AppConfig, run_id: str, rewards: list[RewardRow]) -> list[RegistryDecision]:
    """The decided registry versions of learner run ``run_id``, oldest first, each placed on the
    arm's rollout clock by ``rewards``."""
    from trainer.mlflow_store import open_client

    client = open_client(acfg.mlflow_uri)
    found, token = [], None
    while True:
        page = client.search_model_versions(f"name = '{acfg.mlflow.registered_model}'", page_token=token)
        found += [v for v in page if v.run_id == run_id and "decision" in v.tags]
        token = page.token
        if not token:
            break
    start = rewards[0].t if rewards else 0.0
    out = []
    for version in sorted(found, key=lambda v: int(v.tags["policy_version"])):
        tags = version.tags
        policy = int(tags["policy_version"])
        # a drift restart or roll-back is champion as soon as it is published (Releases.rebase)
        decided_at = policy if tags.get("gate.decision") in DRIFT_CHANGES else policy + acfg.mlflow.register_every
        row = next((r for r in rewards if r.version >= decided_at), None)
        out.append(RegistryDecision(
            str(version.version), policy, decided_at, _label(tags), _gate(tags),
            tags.get("gate.reason", ""), _number(tags, "gate.candidate_value"), _number(tags, "gate.champion_value"),
            _number(tags, "gate.low"), _number(tags, "gate.high"), _number(tags, "gate.candidate_ess"),
            _number(tags, "gate.champion_ess"), tags.get("monitor.tripped", "-"),
            int(tags["gate.canary_n"]) if "gate.canary_n" in tags else None, None if row is None else row.rollout,
            None if row is None else round(row.t - start, 1), _number(tags, "monitor.score_quality")))
    return out


def arm_decisions(run: Run, arm: str) -> list[RegistryDecision] | None:
    """The registry's decisions of ``arm`` in ``run``; None when the arm has no live learner run."""
    config = run.directory / "arms" / arm / "config.yaml"
    if not config.is_file() or arm not in run.arms:
        return None
    acfg = load_app_config(config, environ={})
    learner = learner_run(acfg)
    return None if learner is None else read_decisions(acfg, learner.info.run_id, run.arms[arm].rewards)


def _fmt(value: float, digits: int = 3) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def decision_table(decisions: list[RegistryDecision]) -> list[str]:
    head = ["registry version", "candidate", "decided at", "rollout", "s", "decision", "gate", "V candidate",
            "V champion", "interval (cand. - champ.)", "ESS cand.", "ESS champ.", "canary n", "quality",
            "monitors tripped"]
    rows = [[d.registry_version, f"v{d.policy_version}", f"v{d.decided_at_version}",
             "-" if d.rollout is None else str(d.rollout), "-" if d.seconds is None else f"{d.seconds:.0f}",
             d.decision, d.gate, _fmt(d.candidate_value), _fmt(d.champion_value),
             "-" if math.isnan(d.low) else f"[{d.low:.3f}, {d.high:.3f}]",
             _fmt(d.candidate_ess, 1), _fmt(d.champion_ess, 1), "-" if d.canary_n is None else str(d.canary_n),
             _fmt(d.quality), d.tripped] for d in decisions]
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]


def plot_decisions(run: Run, decided: dict[str, list[RegistryDecision]], path: Path) -> None:
    """Per arm, the moving reward over rollouts with each decision as a vertical tick in its
    colour (:data:`DECISION_COLOURS`) and the preference switches."""
    scenario = run.scenario
    fig = Figure(figsize=(9, 2.4 * len(decided)), layout="constrained")
    axes = fig.subplots(len(decided), 1, squeeze=False)[:, 0]
    for ax, (arm, decisions) in zip(axes, decided.items()):
        band = moving_reward_band([run], arm, scenario.metrics_window)
        if band is not None:
            ax.plot(band.x, band.mean, color="tab:blue", label=f"moving reward (W={scenario.metrics_window})")
        for label, colour in DECISION_COLOURS.items():
            at = [d.rollout for d in decisions if d.decision == label and d.rollout is not None]
            if at:
                ax.vlines(at, 0.0, 0.12, colors=colour, linewidth=2, label=label)
        mark_switches(ax, scenario)
        ax.set_title(f"{arm}: registry decisions", fontsize=10)
        ax.set(ylabel="reward", ylim=(-0.05, 1.05))
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    axes[-1].set_xlabel("rollout")
    fig.savefig(path, dpi=100)


def write_gate_report(runs: list[Run], arms: list[str], out_dir: Path) -> list[str]:
    """The report's section on the registry (Markdown lines) for the first seed's run, with its
    plot in ``out_dir``; no lines when no arm has a live learner run."""
    run = runs[0]
    decided = {arm: found for arm in arms if (found := arm_decisions(run, arm)) is not None}
    if not decided:
        return []
    lines = ["", "## Registry decisions (promotion gate and monitors)", "",
             "Read from MLflow: every decided candidate of each arm's learner run"
             + (f" (seed directory {run.directory.name})" if len(runs) > 1 else "") + ". The release of version "
             "\"decided at\" (the candidate plus `mlflow.register_every`; a drift restart: itself) decided; "
             "rollout and s: the first judged rollout that version answered, and its time from the arm's first. "
             "V: the gate's self-normalised estimate of each version's reward on the same window (with a "
             "canary, `deploy.canary_share`, the window includes the champion's own \"canary n\" answers since "
             "the candidate's registration, and every answer is weighed against the mixture of serving version "
             "and champion); interval: its confidence interval on candidate minus champion; quality: the "
             "judge's mean answer quality on the candidate's answers (the quality monitor, "
             "`deploy.monitor_min_scores`). Refused: too few rollouts or an ESS under `deploy.gate_min_ess`; "
             "kept: the interval contained the margin, so the champion stayed "
             "(docs/DEPLOY.md).", ""]
    for arm, decisions in decided.items():
        lines += [f"### {arm}", ""]
        lines += decision_table(decisions) if decisions else ["No candidate was decided."]
        lines.append("")
    plot_decisions(run, decided, out_dir / GATE_PNG)
    return lines + [f"![registry decisions over the run]({GATE_PNG})", ""]
