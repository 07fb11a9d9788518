import json

from online_sao.batch import Rollout, rollouts_from_json, rollouts_to_json


def test_rollout_codec_round_trips_exactly():
    """Every field, ``defaulted`` included: ranks other than 0 get the step's rollouts through this
    codec (trainer.distributed.broadcast_rollouts) and feed the drift detector from them."""
    original = [Rollout("a", [1, 2, 3, 4, 5], [False, False, True, True, True], [0.0, 0.0, -0.5, -0.5, -0.5],
                        [3] * 5, {4: 1.0}),
                Rollout("b", [1, 2, 3, 4], [False, True, False, True],
                        [0.0, -0.123456789012345678, 0.0, -1e-30], [0, 7, 0, 9],
                        {2: 0.1, 3: -2.5}, temperatures=[1.0, 0.7, 1.0, 1.3], top_ps=[1.0, 0.9, 1.0, 0.5],
                        group_id=4, segment="en", scores={"quality": 0.25}, defaulted=True)]
    decoded = rollouts_from_json(json.loads(json.dumps(rollouts_to_json(original))))
    assert decoded == original


def test_the_encoded_rollout_shares_no_list_with_the_rollout():
    rollout = Rollout("a", [1, 2, 3], [False, True, True], [0.0, -0.5, -0.5], [3] * 3, {2: 1.0},
                      scores={"quality": 0.5})
    encoded = rollouts_to_json([rollout])[0]
    for name in ("token_ids", "action_mask", "logprobs", "versions", "temperatures", "top_ps"):
        encoded[name].append(0)
    encoded["scores"]["quality"] = 0.0
    assert rollout == Rollout("a", [1, 2, 3], [False, True, True], [0.0, -0.5, -0.5], [3] * 3, {2: 1.0},
                              scores={"quality": 0.5})


def test_policy_version_is_the_newest_that_sampled_an_action_token():
    # versions off actions are not meaningful (9 on the prompt token is ignored)
    rollout = Rollout("i", [1, 2, 3, 4], [False, True, True, False], [0.0, -1.0, -1.0, 0.0], [9, 3, 4, 0], {3: 1.0})
    assert rollout.policy_version == 4
    assert Rollout("j", [1], [False], [0.0], [5], {0: 1.0}).policy_version == 0
