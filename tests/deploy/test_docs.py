"""docs/DEPLOY.md: its command lines run what the project has, its links point at real files."""

from __future__ import annotations

import re
import shlex

import pytest
import yaml

from tests.deploy.checks import REPO, check_config_env, mlflow_params, parse_cli, parse_torchrun

DOC = REPO / "docs" / "DEPLOY.md"
VALUE_OPTIONS = {"-e", "--env", "-v", "--volume", "-p", "--publish", "--name", "--entrypoint", "--network", "--gpus",
                 "-w", "--workdir", "-u", "--user"}
"""Options of ``docker run`` / ``docker compose run`` that take a value."""


def command_lines(text: str) -> list[str]:
    """Lines of the fenced bash blocks, continuations joined."""
    lines: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line:
                lines.append(line)
    return lines


def container_command(words: list[str]) -> tuple[str, list[str], dict[str, str]]:
    """(entry point, arguments, environment) of ``docker run ... IMAGE args`` or
    ``docker compose run ... SERVICE args``; the image's entry point is ``online-sao``."""
    entrypoint, env, rest = "online-sao", {}, words[3:] if words[1] == "compose" else words[2:]
    while rest and rest[0].startswith("-"):
        option = rest.pop(0)
        if option in VALUE_OPTIONS:
            value = rest.pop(0)
            if option in ("-e", "--env"):
                key, _, val = value.partition("=")
                env[key] = val
            elif option == "--entrypoint":
                entrypoint = value
    target, args = rest[0], rest[1:]
    if words[1] == "compose":
        services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
        assert target in services, f"docker compose run {target}: no such service"
    return entrypoint, args, env


def check_line(line: str) -> str | None:
    """Checks one command line; returns what it was checked as (None: not a project command)."""
    words = shlex.split(line)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words.pop(0)  # VAR=value prefixes
    if not words:
        return None
    if words[:2] == ["docker", "run"] or words[:3] == ["docker", "compose", "run"]:
        entrypoint, args, env = container_command(words)
        check_config_env(env)
        words = [entrypoint, *args]
    if words[0] in ("online-sao", ".venv/bin/online-sao"):
        parse_cli(words[1:])
        return "online-sao"
    if words[0] == "torchrun":
        run = parse_torchrun(words)
        parse_cli(run.module_args)
        return "torchrun"
    if words[0] == "mlflow":
        mlflow_params(words[1:])
        return "mlflow"
    return None


def test_every_project_command_in_the_guide_runs_what_exists():
    checked = [kind for line in command_lines(DOC.read_text()) if (kind := check_line(line))]
    assert {"online-sao", "torchrun", "mlflow"} <= set(checked) and len(checked) >= 5


@pytest.mark.parametrize("line", [
    "online-sao serv",
    "torchrun --nproc-per-node 2 -m apps.cli lean",
    "docker run --rm -e ONLINE_SAO__SERVING__PROT=1 online-sao:cpu serve",
    "docker compose run --rm --entrypoint mlflow nosuchservice artifacts download -u x",
    "MLFLOW_TRACKING_URI=x mlflow artifacts download --uri x",
])
def test_a_wrong_command_in_the_guide_is_caught(line):
    with pytest.raises(AssertionError):
        check_line(line)


def test_links_point_at_files():
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", DOC.read_text()):
        if not target.startswith(("http://", "https://")):
            assert (DOC.parent / target).exists(), f"docs/DEPLOY.md: broken link {target}"


def test_readme_points_at_the_guide():
    assert "(docs/DEPLOY.md)" in (REPO / "README.md").read_text()
