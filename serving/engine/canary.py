"""The canary: a share of requests answered by the registry's champion instead of the newest version.

The promotion gate (``trainer/deploy.py``) compares a candidate with the champion on the same
recent traffic. Without a canary every answer comes from the newest versions and the champion's
reward is an importance-sampling estimate from them; once the candidate has moved far from the
champion those weights concentrate on a few answers and the gate refuses to decide. With a
canary, ``deploy.canary_share`` of the requests are answered by the champion, held in an engine
of its own, so the champion's estimate rests on answers it sampled itself, at the same time and
for the same users as the candidate's. Every token still carries the version that sampled it;
nothing else in the record changes.

The draw is per trajectory, not per request: every turn of a multi-turn trajectory (a continuation,
``parent_interaction_id``) goes to the engine that answered its first turn, so users see one policy
for the whole conversation and the gate, which counts as the champion's own only trajectories whose
every action token it sampled, gets ``share`` of them rather than ``share ** turns``. The draw is a
hash of the trajectory's first interaction id (:attr:`GenerationRequest.trajectory_id`) and the
seed, mapped to [0, 1) (:func:`canary_draw`): nothing is kept per trajectory, and the route does
not depend on the order requests arrive in.

The draw alone would move a trajectory whose first turn the canary did not route (answered by the
newest engine before the first champion was loaded, or during an operator's hold) to the champion
at its next turn once the canary routes again. So a continuation drawn for the champion stays with
the newest engine when that engine still serves the version that sampled its previous turn and the
champion does not (:attr:`GenerationRequest.previous_version`, from the record it continues); a
continuation drawn for the newest engine goes there, as every such turn did. A trajectory can still
change engine across a transition when the newest engine moved on between two of its turns: one
begun before the first champion, whose next turn comes after both the champion's loading and a newer
version, goes to the champion by its draw. A continuation whose champion changed since its previous
turn still goes to the champion engine (its tokens then carry two champion versions, so the gate
counts it as neither's).

:class:`CanaryEngine` is an ``InferenceEngine`` over two engines of any kind: ``newest`` follows
the published versions (``swap_weights``, what the weights follower calls for ``publish`` and
``rollback`` notices) and ``champion`` takes ``champion`` notices (:meth:`swap_champion`). Until
the first champion is loaded every request goes to ``newest``, and so does every request while an
operator holds the replica at one version (:meth:`hold_all_on_newest`): a hold means one version
answers, whatever the champion is.
"""

from __future__ import annotations

import hashlib
import logging
from typing import AsyncIterator, Protocol, runtime_checkable

import torch

from serving.engine.base import GenerationRequest, InferenceEngine, SwapResult, TokenEvent

log = logging.getLogger(__name__)

DEFAULT_SEED = 0
"""The seed of the draw when none is given (every replica draws alike)."""


def canary_draw(trajectory_id: str, seed: int | None = None) -> float:
    """A number in [0, 1), uniform over trajectory ids, fixed by ``trajectory_id`` and ``seed``: the
    trajectory goes to the champion when it is under the share."""
    key = f"{DEFAULT_SEED if seed is None else seed}\x1f{trajectory_id}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") / 2.0 ** 64


@runtime_checkable
class ChampionServing(Protocol):
    """An engine that also answers with the registry's champion (the weights follower's view)."""

    @property
    def champion_version(self) -> int | None: ...

    def swap_champion(self, version: int, state_dict: dict[str, torch.Tensor]) -> SwapResult: ...

    def hold_all_on_newest(self, held: bool) -> None: ...


class CanaryEngine:
    """Routes each trajectory to the champion with probability ``share``, otherwise to the newest version
    (every turn of a trajectory alike: :func:`canary_draw` of its first interaction id and ``seed``; a
    continuation of a turn the newest engine answered stays there while it serves that turn's version)."""

    def __init__(self, newest: InferenceEngine, champion: InferenceEngine, share: float,
                 seed: int | None = None) -> None:
        if not 0 <= share < 1:
            raise ValueError(f"canary share {share} is not in [0, 1)")
        self.newest = newest
        self.champion = champion
        self.share = share
        self.seed = seed
        self._champion_version: int | None = None
        self.routed = {"newest": 0, "champion": 0}
        """Requests sent to each engine so far."""
        self.held = False
        """An operator's hold is in force: every request goes to ``newest`` (the held version)."""

    @property
    def policy_version(self) -> int:
        """The newest version (what serving reports and the follower compares notices with)."""
        return self.newest.policy_version

    @property
    def champion_version(self) -> int | None:
        """The champion being served to the canary share (None until one is loaded)."""
        return self._champion_version

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        to_champion = self._to_champion(request)
        engine = self.champion if to_champion else self.newest
        self.routed["champion" if to_champion else "newest"] += 1
        async for event in engine.generate(request):
            yield event

    def _to_champion(self, request: GenerationRequest) -> bool:
        """Whether the champion answers ``request``: never while held or before the first champion, else when
        its trajectory's draw is under the share, unless it continues a turn the newest engine answered."""
        if self.held or self._champion_version is None:
            return False
        trajectory = request.trajectory_id if request.trajectory_id is not None else request.request_id
        return canary_draw(trajectory, self.seed) < self.share and not self._continues_on_newest(request)

    def _continues_on_newest(self, request: GenerationRequest) -> bool:
        """Whether the previous turn of a continuation drawn for the champion was the newest engine's (answered
        before the first champion, or during a hold): the newest engine still serves the version that sampled
        it and the champion does not."""
        previous = request.previous_version
        return previous is not None and previous == self.newest.policy_version and previous != self._champion_version

    def swap_weights(self, version: int, state_dict: dict[str, torch.Tensor], force: bool = False) -> SwapResult:
        return self.newest.swap_weights(version, state_dict, force)

    def swap_champion(self, version: int, state_dict: dict[str, torch.Tensor]) -> SwapResult:
        """Load ``version`` as the champion (forced: a restart's champion can be any version).
        Refused weights leave the previous champion (or none) in place."""
        result = self.champion.swap_weights(version, state_dict, force=True)
        if result.applied:
            self._champion_version = version
            log.info("canary: champion v%d answers %.0f%% of trajectories", version, 100 * self.share)
        return result

    def hold_all_on_newest(self, held: bool) -> None:
        """While ``held`` the champion answers nothing; it stays loaded and follows champion notices,
        so a release gives the canary its share back at once."""
        if held != self.held:
            log.info("canary: %s", "paused by an operator's hold: the held version answers every request"
                     if held else "resumed: the champion answers its share again")
        self.held = held

    async def start(self) -> None:
        await self.newest.start()
        await self.champion.start()

    async def stop(self) -> None:
        await self.newest.stop()
        await self.champion.stop()
