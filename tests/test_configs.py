"""Every run file in configs/ validates against the config tree."""

from pathlib import Path

import pytest

from apps.config import load_app_config

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_run_config_validates(path):
    load_app_config(path, environ={})


def test_there_are_run_configs():
    assert any(p.name == "local.yaml" for p in CONFIGS)
