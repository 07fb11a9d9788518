"""The learner benchmark's command line (overrides reach the learner's YAML as nested sections), the
notice a trained rollout is first served under, and the learner's thread count as reported."""

import os

import pytest

from benchmarks.bench_learner import first_publication, learner_threads, main, nest, parse_overrides
from online_sao.schemas import WeightsNotice


def test_overrides_are_read_as_yaml_and_nested():
    overrides = parse_overrides(["trainer.min_rollouts=1", "trainer.max_wait_s=null", "algorithm.name=sao"])
    assert overrides == {"trainer.min_rollouts": 1, "trainer.max_wait_s": None, "algorithm.name": "sao"}
    raw = {"trainer": {"checkpoint_every": 5}}
    for key, value in overrides.items():
        nest(raw, key.split("."), value)
    assert raw == {"trainer": {"checkpoint_every": 5, "min_rollouts": 1, "max_wait_s": None},
                   "algorithm": {"name": "sao"}}


def test_an_override_without_a_value_is_refused():
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        parse_overrides(["trainer.min_rollouts"])


def test_out_naming_a_directory_is_refused_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path)])
    assert "directory" in capsys.readouterr().err


def _notice(step: int, version: int) -> WeightsNotice:
    return WeightsNotice(version=version, step=step, location=f"v{version}", checksum="0" * 64)


def test_a_step_that_did_not_publish_is_served_by_the_next_step_that_did():
    # trainer.publish_every 3: steps 3 and 6 published versions 1 and 2
    notices = {3: _notice(3, 1), 6: _notice(6, 2)}
    steps = sorted(notices)
    assert first_publication(steps, notices, 1).version == 1
    assert first_publication(steps, notices, 3).version == 1
    assert first_publication(steps, notices, 4).version == 2
    assert first_publication(steps, notices, 7) is None


def test_the_learners_threads_are_those_of_a_process_started_with_its_environment():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    assert learner_threads(env) == 1
    assert learner_threads({**os.environ, "OMP_NUM_THREADS": "2"}) == 2
