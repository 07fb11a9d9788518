"""``online-sao weights``: what serving's weights follow, and an operator's hold on them.

``status`` reads the weights topic; ``hold`` pins every serving replica to one version until
``release`` (serving/weights_hold.py says what a replica does with them). A hold first copies the
version's weights out of the learner's reach (``<weight store>/held/``: the learner prunes its
store to the newest ``trainer.keep_versions`` and the registry's versions, and a held version
must stay loadable for a replica that restarts during the hold), then announces the copy.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import fsspec
from pydantic import ValidationError

from online_sao.config import Config
from online_sao.schemas import RecordError, WeightsNotice, decode
from online_sao.weights import CorruptWeights, FileWeightStore, open_weight_store
from serving.weights_hold import plan
from streams.base import StreamBackend
from streams.records import publish
from streams.tail import iter_records_since

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

HELD_DIR = "held"
"""Folder of the weight store holding the held version's copy (at most the newest hold's)."""
READ_TIMEOUT_S = 30.0
"""Longest wait for the next record while reading the weights topic (compacted: a few records)."""
SEND_TIMEOUT_S = 30.0
"""Longest wait for the broker to acknowledge a hold or release."""
HOLD_RETARGETS = 3
"""Times a hold of the version served now copies again when the learner published a newer one during
the copy (seconds on a busy machine): the hold then lands on what replicas serve when it is sent, not
on what they served when the command began, to which it took them back. After these it holds the
last version copied, with a warning."""


class HoldError(Exception):
    """A hold or release that cannot be made as asked; the message says why and what to do."""


@dataclass
class WeightsTopic:
    """What the weights topic says for one model, read from its start."""

    published: WeightsNotice | None = None
    """The newest ``publish``."""
    following: WeightsNotice | None = None
    """The notice a replica converges on without a hold (every version assumed loadable)."""
    champion: WeightsNotice | None = None
    hold: WeightsNotice | None = None
    """The hold in force (None: none, or released)."""
    by_version: dict[int, WeightsNotice] = field(default_factory=dict)
    """The newest notice of the learner's naming each version still on the topic."""


def read_weights_topic(backend: StreamBackend, topic: str, model: str) -> WeightsTopic:
    state = WeightsTopic()
    current = -1
    for message in iter_records_since(backend, [topic], 0, READ_TIMEOUT_S):
        try:
            notice = decode(message.value, WeightsNotice)
        except RecordError:
            continue  # serving's follower dead-letters it
        if notice.model != model:
            continue
        if notice.action == "hold":
            state.hold = notice
            continue
        if notice.action == "release":
            if state.hold is not None and notice.version != state.hold.version:  # as a replica does
                log.warning("a release of v%d ignored: the hold in force is v%d's, which only a release of v%d "
                            "ends", notice.version, state.hold.version, state.hold.version)
            else:
                state.hold = None
            continue
        state.by_version[notice.version] = notice
        if notice.action == "champion":
            state.champion = notice
            continue
        if notice.action == "publish":
            state.published = notice
        if plan([notice], current):  # what a replica reading the notices one by one would load
            state.following, current = notice, notice.version
    return state


def hold(cfg: Config, backend: StreamBackend, version: int | None = None, champion: bool = False,
         reason: str | None = None) -> WeightsNotice:
    """Pin every replica to ``version`` (the champion with ``champion``; by default the version the
    replicas serve now: the held one during a hold) and return the hold notice sent. Nothing is copied,
    deleted or sent unless the notice can be sent (a bad reason is refused first); the copy of an
    earlier hold is deleted only once the broker has the new notice."""
    if version is not None and version < 0:
        raise HoldError(f"versions are numbered from 0, got {version}")
    topic, model = cfg.kafka.topics.weights, cfg.serving.model_name
    state = read_weights_topic(backend, topic, model)
    target = _target(cfg, state, version, champion)
    if state.hold is not None and target.version == state.hold.version and _copy_kept(state.hold):
        notice = _notice(state.hold, action="hold", reason=reason, created_at=time.time())  # a new reason
        _send(backend, topic, notice)
        return notice
    if target.action == "hold":  # the hold in force, its copy gone: copied again from the learner's store
        target = _learners_notice(state, target)
    _hold_notice(target, target.location, target.checksum, reason)  # refused here, before the store is touched
    store = _file_store(cfg)
    if store is None:
        raise HoldError(f"a hold copies the version out of the learner's pruning, which needs the file weight "
                        f"store; trainer.weight_store is {cfg.weight_store_url!r}")
    held = FileWeightStore(f"{cfg.weight_store_url.rstrip('/')}/{HELD_DIR}")
    following_served = version is None and not champion and state.hold is None  # not a named or held version
    for retarget in range(HOLD_RETARGETS + 1):
        weights = _load(store, target)
        ref = held.save(target.version, weights)
        if not following_served:
            break
        now = read_weights_topic(backend, topic, model)  # the learner may have published during the copy
        served = now.following
        if now.hold is not None or served is None or served.version == target.version:
            break  # another operator's hold landed meanwhile: this one goes out after it, as before
        if retarget == HOLD_RETARGETS:
            log.warning("replicas moved on to v%d while v%d was copied, %d times: holding v%d takes them back to it",
                        served.version, target.version, HOLD_RETARGETS, target.version)
            break
        log.info("replicas moved on to v%d while v%d was copied: holding v%d", served.version, target.version,
                 served.version)
        held.delete(target.version)  # no hold is in force, and this one will not name it
        target = served
    notice = _hold_notice(target, ref.location, ref.checksum, reason)
    _send(backend, topic, notice)
    _keep_the_copy_in_force(backend, topic, model, held, target.version, weights)
    return notice


def _load(store: FileWeightStore, target: WeightsNotice) -> dict[str, torch.Tensor]:
    try:
        return store.load(target.location, target.checksum)
    except (FileNotFoundError, CorruptWeights) as exc:
        raise HoldError(f"v{target.version}'s weights cannot be loaded ({exc}); the learner keeps the newest "
                        f"trainer.keep_versions versions and the registry's candidate and champion") from None


def _copy_kept(notice: WeightsNotice) -> bool:
    """Whether the held copy ``notice`` names is there (another operator's hold may have deleted it)."""
    fs, path = fsspec.core.url_to_fs(notice.location)
    return fs.exists(path)


def _learners_notice(state: WeightsTopic, held: WeightsNotice) -> WeightsNotice:
    """The learner's notice of the held version, whose copy is gone: where to copy it from again."""
    found = state.by_version.get(held.version)
    if found is None:
        raise HoldError(f"v{held.version} is held but its copy is gone ({held.location}), and the weights topic "
                        f"no longer names v{held.version} to copy it from again; hold another version "
                        f"(versions it names: {sorted(state.by_version)}) or `online-sao weights release`")
    return found


def _keep_the_copy_in_force(backend: StreamBackend, topic: str, model: str, held: FileWeightStore, version: int,
                            weights: dict[str, torch.Tensor]) -> None:
    """Delete every copy under held/ but the hold in force's, read back once this hold was sent: another
    operator's hold may have landed after it, and that hold's copy must stay (deleting every copy but
    this hold's left the hold in force without one). When this hold is in force and another hold's
    clean-up deleted its copy meanwhile, it is written again."""
    in_force = read_weights_topic(backend, topic, model).hold
    keep = None if in_force is None else in_force.version
    for older in held.versions():
        if older != keep:
            held.delete(older)
    if keep == version and version not in held.versions():
        held.save(version, weights)


def release(cfg: Config, backend: StreamBackend, reason: str | None = None) -> WeightsNotice | None:
    """End the hold in force and return the release sent (None: no hold was in force)."""
    topic, model = cfg.kafka.topics.weights, cfg.serving.model_name
    held = read_weights_topic(backend, topic, model).hold
    if held is None:
        return None
    notice = _notice(held, action="release", reason=reason, created_at=time.time())
    _send(backend, topic, notice)
    now = read_weights_topic(backend, topic, model).hold
    if now is not None:
        # another operator's hold landed between the read and this release, which replicas ignore: it
        # is the newest record under the hold key now, and compaction would keep it alone, so a replica
        # starting later would not find the hold the others keep. The hold in force goes out again.
        _send(backend, topic, _notice(now, created_at=time.time()))
        raise HoldError(f"v{now.version} is held (another `weights hold` landed around this release of "
                        f"v{held.version}, which only ends v{held.version}'s hold): replicas stay on v{now.version} "
                        f"(its hold sent again, so a replica starting later finds it); `online-sao weights release` "
                        f"again ends it")
    return notice


def _hold_notice(target: WeightsNotice, location: str, checksum: str, reason: str | None) -> WeightsNotice:
    """The hold of ``target``'s version, its weights at ``location``."""
    return _notice(WeightsNotice(action="hold", version=target.version, location=location, checksum=checksum,
                                 model=target.model, step=target.step), reason=reason)


def _notice(base: WeightsNotice, **changes) -> WeightsNotice:
    """``base`` with ``changes``, validated as any notice a replica decodes (``model_copy`` validates
    nothing: a release whose reason was too long was sent, and every replica refused it and stayed held)."""
    try:
        return WeightsNotice.model_validate({**base.model_dump(), **changes})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise HoldError(f"the notice cannot be sent ({problems})") from None


def _target(cfg: Config, state: WeightsTopic, version: int | None, champion: bool) -> WeightsNotice:
    if champion:
        if state.champion is None:
            raise HoldError("the weights topic names no champion yet (the registry promotes one at its first "
                            "decision)")
        return state.champion
    if version is None:
        if state.hold is not None:  # what the replicas serve now
            return state.hold
        if state.following is None:
            raise HoldError("nothing is published yet: serving answers with its base model")
        return state.following
    if version not in state.by_version:
        raise _not_on_topic(cfg, state, version)
    return state.by_version[version]


def _not_on_topic(cfg: Config, state: WeightsTopic, version: int) -> HoldError:
    """Why ``version``, which the topic does not name, cannot be held: never published (above every
    version the topic and the learner's store know: a rolled-back version's notice may be compacted
    away, its file stays) or compacted away; with the versions that can be (as ``status`` lists them)."""
    store = _file_store(cfg)
    holdable = holdable_versions(cfg, state)
    if holdable is None:  # no store to tell which have their weights: the hold needs one anyway
        can = f"versions the topic names: {', '.join(f'v{v}' for v in sorted(state.by_version)) or 'none'}"
    else:
        can = f"versions that can be held: {', '.join(f'v{v}' for v in holdable) or 'none'}"
    if version == 0:
        return HoldError(f"v0 is the base model (model.path), which the learner never publishes: it cannot be held; {can}")
    held = () if state.hold is None else (state.hold.version,)
    newest = max((*state.by_version, *held, *(() if store is None else store.versions())), default=None)
    if newest is None or version > newest:
        return HoldError(f"v{version} was never published "
                         f"({'nothing is published yet' if newest is None else f'newest v{newest}'}); {can}")
    return HoldError(f"the weights topic no longer names v{version} (compaction keeps the newest notice and the "
                     f"champion's); {can}")


def _send(backend: StreamBackend, topic: str, notice: WeightsNotice) -> None:
    producer = backend.producer()
    try:
        publish(producer, topic, notice)
        producer.flush(SEND_TIMEOUT_S)
    finally:
        producer.close()


def _file_store(cfg: Config) -> FileWeightStore | None:
    """The learner's weight store, if it is the file store a hold can copy from (else None)."""
    store = open_weight_store(cfg.weight_store_url)
    return store if isinstance(store, FileWeightStore) else None


def holdable_versions(cfg: Config, state: WeightsTopic) -> list[int] | None:
    """The versions a hold can name: on the topic, their weights still in the store (None: the
    store is not one a hold can copy from)."""
    store = _file_store(cfg)
    return None if store is None else sorted(set(state.by_version) & set(store.versions()))


def describe(state: WeightsTopic, now: float, holdable: list[int] | None = None) -> list[str]:
    """``status``'s lines."""
    def line(label: str, notice: WeightsNotice | None) -> str:
        if notice is None:
            return f"{label}: none"
        return f"{label}: v{notice.version} (step {notice.step}, {now - notice.created_at:.0f} s ago)"

    followed = "followed" if state.hold is None else "followed once released"
    lines = [line("newest published", state.published), line(followed, state.following),
             line("champion", state.champion)]
    if state.hold is None:
        lines.append("hold: none (replicas follow the learner)")
    else:
        lines.append(f"{line('hold', state.hold)}: {state.hold.reason or 'no reason given'}; "
                     f"`online-sao weights release` ends it")
    if holdable is not None:
        lines.append(f"can be held: {', '.join(f'v{v}' for v in holdable) or 'none'} (named on the weights topic, "
                     f"weights still in the store)")
    return lines


def run_weights_cli(cfg: Config, backend: StreamBackend, action: str, version: int | None, champion: bool,
                    reason: str | None) -> int:
    try:
        if action == "hold":
            notice = hold(cfg, backend, version, champion, reason)
            print(f"held: every replica answers with v{notice.version} until `online-sao weights release` "
                  f"(weights copied to {notice.location})")
        elif action == "release":
            notice = release(cfg, backend, reason)
            print("no hold in force" if notice is None else
                  f"released v{notice.version}: replicas follow the learner's versions again")
        else:
            state = read_weights_topic(backend, cfg.kafka.topics.weights, cfg.serving.model_name)
            print("\n".join(describe(state, time.time(), holdable_versions(cfg, state))))
    except HoldError as exc:
        print(f"online-sao weights {action}: {exc}", file=sys.stderr)
        return 1
    return 0
