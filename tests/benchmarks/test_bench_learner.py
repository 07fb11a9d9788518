"""The learner benchmark's command line: overrides reach the learner's YAML as nested sections."""

import pytest

from benchmarks.bench_learner import main, nest, parse_overrides


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
