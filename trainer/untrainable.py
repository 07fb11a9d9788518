"""Interactions that can train nothing under the learner's model, refused as the feed reads them
(:class:`trainer.feed.Feed`), before they join and count toward a step.

The record codec cannot know the model: a token id outside its vocabulary passes it, and so does a
record without an action token (nothing the policy sampled). Both used to join and be taken for a
step, then left out when the step turned them into rollouts (:func:`trainer.rollouts.to_rollouts`, which
still checks, for the other readers of logged rollouts). Under several ranks a step needs a unit (a
rollout, a grpo group) for each rank; one left with fewer after that was dropped whole, and its usable
rollouts, which the join had recorded as trained, were never trained: lost for good after the next
checkpoint. Refused as the join meets them (``RewardJoiner.add_interaction``'s ``admit``), they never
count toward a step, and are finished untrained as a cut answer is: a copy is a duplicate, a reward late.
"""

from __future__ import annotations

import logging

from online_sao.schemas import Interaction

log = logging.getLogger("trainer.feed")


def outside_vocabulary(interaction: Interaction, vocab_size: float) -> str | None:
    """Why ``interaction`` has a token id the model's vocabulary (``vocab_size`` ids) does not hold,
    or None when it has none."""
    largest = max(max(interaction.prompt_ids), max(interaction.response_ids, default=0))
    if largest < vocab_size:
        return None
    return (f"interaction {interaction.interaction_id}: token id {largest} outside the model's vocabulary "
            f"({vocab_size})")


def trainable(interaction: Interaction, vocab_size: float, counters: dict[str, float]) -> bool:
    """Whether ``interaction`` can train anything under a model of ``vocab_size`` ids; if not, it is
    counted: ``invalid_rollouts`` (a token id outside the vocabulary, named in a warning) or
    ``empty_rollouts`` (no action token)."""
    problem = outside_vocabulary(interaction, vocab_size)
    if problem is not None:
        counters["invalid_rollouts"] += 1
        log.warning("interaction not trained on: %s", problem)
        return False
    if not interaction.logprobs:  # one per action token (the schema checks it)
        counters["empty_rollouts"] += 1
        return False
    return True
