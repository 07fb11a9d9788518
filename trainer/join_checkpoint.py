"""The reward join's state as JSON-serialisable data: :meth:`trainer.join.RewardJoiner.state_dict`
and :meth:`~trainer.join.RewardJoiner.load_state_dict` (a learner checkpoint's ``joiner``).

A checkpoint leaves the id memory out of that JSON: the learner's thread takes
:meth:`~trainer.id_memory.IdMemory.snapshot` (a dict copy) and the checkpoint writer encodes it in
a file of its own (:func:`~trainer.id_memory.encode_snapshot`). At 100,000 remembered ids, JSON
lists cost the learner's thread about 0.2 s and every checkpoint 10 MB of meta.json.
"""

from __future__ import annotations

import heapq
import logging
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from online_sao.schemas import Interaction
from trainer.id_memory import IdMemory, MemorySnapshot, anchor_time
from trainer.join_state import Claim, Contribution, Entry, JoinCounters
from trainer.reward_range import outside_range

if TYPE_CHECKING:
    from trainer.join import RewardJoiner

log = logging.getLogger(__name__)

LEGACY_FINISHED_MEMORY_WINDOWS = 2.0
"""Checkpoints written before the id memory remembered finished ids until ``ts + 2 windows``;
loading one recovers the anchor as that time minus two windows."""


def joiner_state(joiner: "RewardJoiner", with_memory: bool = True) -> dict[str, Any]:
    """The joiner's state; its id memory too if ``with_memory``."""
    state = {
        "watermark": joiner.watermark,
        "waiting": [entry_state(e) for e in joiner._waiting.values()],
        "ready": [entry_state(e) for e in joiner._ready.values()],
        "held": [[iid, [contribution_state(c) for c in cs]] for iid, cs in joiner._held.items()],
        "counters": asdict(joiner.counters),
    }
    if with_memory:
        state["memory"] = joiner.memory.state_dict()
    return state


def load_joiner_state(joiner: "RewardJoiner", state: dict[str, Any], memory: MemorySnapshot | None = None) -> None:
    """Restore :func:`joiner_state` into ``joiner``, its id memory from ``memory`` when given (else
    from ``state``). Also reads checkpoints written before trajectories and the id memory (their
    finished ids count as trained, their entries as claiming nothing)."""
    joiner.watermark = state["watermark"]
    left_out: list[dict[str, Any]] = []
    joiner._waiting = {e.iid: e for e in _entries(state["waiting"], left_out)}
    joiner._ready = OrderedDict((e.iid, e) for e in _entries(state["ready"], left_out))
    joiner._held = OrderedDict((iid, [contribution_from(c) for c in cs]) for iid, cs in state["held"])
    refused = _drop_refused(joiner)
    joiner._claims = {a: e.iid for e in [*joiner._waiting.values(), *joiner._ready.values()] for a in e.claimed}
    joiner._deadlines = [(joiner._window_end(e), iid) for iid, e in joiner._waiting.items()]
    heapq.heapify(joiner._deadlines)
    joiner.memory = IdMemory(joiner.cfg.id_memory_s, joiner.max_pending)
    if memory is not None:
        joiner.memory.restore(memory)
    elif "memory" in state:
        joiner.memory.load_state_dict(state["memory"])
    for iid, forget_after in state.get("finished", []):
        joiner.memory.remember(iid, forget_after - LEGACY_FINISHED_MEMORY_WINDOWS * joiner.cfg.window_s,
                               trained=True, seen=True)
    for s in left_out:  # finished untrained, as the join finishes one it gives up: a later reward is late
        for iid, anchor in [(s["interaction"]["interaction_id"], s.get("anchor", s["ts"])),
                            *((iid, anchor) for iid, anchor, _ in s.get("claimed", []))]:
            joiner.memory.remember(iid, anchor, trained=False, seen=True)
    known = {f.name for f in fields(JoinCounters)}
    joiner.counters = JoinCounters(**{k: v for k, v in state["counters"].items() if k in known})
    joiner.counters.refused_on_resume += refused.count
    joiner.counters.joined -= refused.unjoined


@dataclass
class Refused:
    """What :func:`_drop_refused` took out of a restored join buffer."""

    count: int = 0
    """Rewards not applied."""
    unjoined: int = 0
    """Ready interactions (counted joined) waiting again: no reward left, or no longer rated by every
    source they wait for."""
    why: dict[str, int] = field(default_factory=dict)
    """Reason -> rewards."""


def _drop_refused(joiner: "RewardJoiner") -> Refused:
    """Take out the rewards the joiner's ``reward.*`` settings refuse, as :meth:`RewardJoiner.add_reward`
    and the feed's range check would now: the checkpoint's join buffer was read under the settings of
    its time, and a narrowed ``reward.min_value``..``max_value`` or a source dropped from
    ``reward.sources`` let the rewards it held train after the restart. A ready interaction left with
    no reward of any kind waits again (its window closes it as the settings say: a default, or dropped)."""
    refused = Refused()

    def kept(contributions: list[Contribution]) -> list[Contribution]:
        out = []
        for c in contributions:
            why = _refusal(c, joiner.cfg)
            if why is None:
                out.append(c)
            else:
                refused.count += 1
                refused.why[why] = refused.why.get(why, 0) + 1
        return out

    touched = []
    for entry in [*joiner._waiting.values(), *joiner._ready.values()]:
        before = len(entry.contributions)
        entry.contributions = kept(entry.contributions)
        if len(entry.contributions) < before:
            touched.append(entry)
    for iid in list(joiner._held):
        joiner._held[iid] = kept(joiner._held[iid])
        if not joiner._held[iid]:
            del joiner._held[iid]
    # ready but no longer so by today's settings: no reward left, or, its window still open, no longer
    # rated by every source it waits for (it trained mid-window, and a valid reward in time came late)
    for entry in [e for e in touched if e.iid in joiner._ready and not e.defaulted
                  and (not e.contributions or (not e.closed and not joiner._rated(e)))]:
        del joiner._ready[entry.iid]
        entry.closed, entry.ready_at = False, 0.0
        joiner._waiting[entry.iid] = entry
        refused.unjoined += 1
    if refused.count:
        log.warning("checkpoint: %d rewards of the join buffer are not applied, refused by today's reward.* "
                    "settings (%s)%s", refused.count, ", ".join(f"{n} {why}" for why, n in sorted(refused.why.items())),
                    f"; {refused.unjoined} interactions no longer ready wait again" if refused.unjoined else "")
    return refused


def _refusal(c: Contribution, cfg) -> str | None:
    """Why ``cfg`` (:class:`~online_sao.config.RewardConfig`) refuses contribution ``c``, or None."""
    if cfg.sources is not None and c.source is not None and c.source not in cfg.sources:  # None: from before sources
        return "from a source reward.sources leaves out"
    if outside_range([("value", c.value), *((f"turn {t}", v) for t, v in c.turns.items())], cfg) is not None:
        return f"outside reward.min_value..max_value [{cfg.min_value:g}, {cfg.max_value:g}]"
    return None


def _entries(states: list[dict[str, Any]], left_out: list[dict[str, Any]]) -> list[Entry]:
    """The checkpoint's entries (:func:`entry_from`). One whose interaction today's record checks refuse
    (a checkpoint of an older version, which took it: ``turn_ends`` out of order, say) goes to
    ``left_out`` and is named, with the earlier turns it holds: it could not be trained as it is, and
    the learner could not start at all."""
    entries = []
    for s in states:
        try:
            entries.append(entry_from(s))
        except ValidationError as exc:
            left_out.append(s)
            log.error("checkpoint: interaction %s of the join buffer is left out, with the earlier turns it holds "
                      "(%s) and %d rewards joined to it: the record checks refuse it (%s)",
                      s["interaction"]["interaction_id"], [c[0] for c in s.get("claimed", [])] or "none",
                      len(s.get("contributions", [])), exc.errors()[0]["msg"][:300])
    return entries


def contribution_state(c: Contribution) -> dict[str, Any]:
    return {"value": c.value, "turns": [[t, v] for t, v in c.turns.items()], "ts": c.ts, "origin": c.origin,
            "scores": dict(c.scores), "key": c.key, "source": c.source}


def contribution_from(s: dict[str, Any]) -> Contribution:
    """A :func:`contribution_state`; checkpoints from before named scores (or digests, or sources)
    have none."""
    return Contribution(s["value"], {int(t): v for t, v in s["turns"]}, s["ts"], s.get("origin"),
                        dict(s.get("scores", {})), s.get("key"), s.get("source"))


def entry_state(e: Entry) -> dict[str, Any]:
    """An :class:`Entry` as JSON-serialisable data (the join's checkpoint)."""
    return {"interaction": e.interaction.model_dump(mode="json"), "ts": e.ts, "anchor": e.anchor,
            "contributions": [contribution_state(c) for c in e.contributions], "defaulted": e.defaulted,
            "claimed": [[iid, c.anchor, c.seen] for iid, c in e.claimed.items()], "ready_at": e.ready_at,
            "closed": e.closed}


def entry_from(s: dict[str, Any]) -> Entry:
    """An :func:`entry_state`; also one written before trajectories (no anchor or claims),
    grpo's timeout (no ``ready_at``: the interaction's time) or ``closed`` (closed if defaulted:
    the one closed entry such a checkpoint tells apart)."""
    interaction = Interaction.model_validate(s["interaction"])
    return Entry(interaction, s["ts"], s.get("anchor", anchor_time(interaction.created_at, s["ts"])),
                 [contribution_from(c) for c in s["contributions"]], s["defaulted"],
                 {iid: Claim(anchor, seen) for iid, anchor, seen in s.get("claimed", [])},
                 s.get("ready_at", s["ts"]), s.get("closed", s["defaulted"]))
