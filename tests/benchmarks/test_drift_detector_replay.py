from benchmarks.drift_detector_replay import parse_settings, replay
from online_sao.drift import DriftSettings


def test_replay_counts_false_alarms_delays_and_misses():
    settings = DriftSettings(recent=2, reference=2, min_drop=0.5, z_threshold=4.0)
    # stream 1: a false alarm at index 3 (1, 1 | 0, 0) before the switch at 6; after the switch the
    # windows refill and 1, 1 | 0, 0 alarms again at index 9: delay 3
    # stream 2: switch at 4 with nothing to detect (rewards stay low): missed
    streams = [([1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0], [6]), ([0, 0, 0, 0, 0, 0, 0], [4])]
    r = replay(streams, settings, horizon=100)
    assert (r.streams, r.false_alarms, r.first_phase_rewards) == (2, 1, 10)
    assert (r.switches, r.missed, r.delays) == (2, 1, [3])
    # within a horizon of 3 rollouts the first stream's alarm at 9 (delay 3) is too late
    assert replay(streams, settings, horizon=3).missed == 2


def test_settings_parse():
    assert parse_settings("16,48,0.2,3") == DriftSettings(16, 48, 0.2, 3.0)
