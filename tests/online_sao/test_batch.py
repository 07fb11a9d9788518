import json

from online_sao.batch import Rollout, rollouts_from_json, rollouts_to_json


def test_rollout_codec_round_trips_exactly():
    original = [Rollout("a", [1, 2, 3, 4, 5], [False, False, True, True, True], [0.0, 0.0, -0.5, -0.5, -0.5],
                        [3] * 5, {4: 1.0}),
                Rollout("b", [1, 2, 3, 4], [False, True, False, True],
                        [0.0, -0.123456789012345678, 0.0, -1e-30], [0, 7, 0, 9],
                        {2: 0.1, 3: -2.5}, temperatures=[1.0, 0.7, 1.0, 1.3], top_ps=[1.0, 0.9, 1.0, 0.5],
                        group_id=4)]
    decoded = rollouts_from_json(json.loads(json.dumps(rollouts_to_json(original))))
    assert decoded == original
