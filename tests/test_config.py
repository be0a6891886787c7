"""Settings from a TOML file and RINGQ_* variables under the flags (services/config.py), for the node's and
the coordinator's real parsers: one precedence, flag > environment > file > default, and bad keys named."""

from __future__ import annotations

from pathlib import Path

import pytest

from services import config
from services.node import parser as node_parser

REQUIRED = ["--id", "node1", "--coordinator", "127.0.0.1:7000"]


def _file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "ringq.toml"
    path.write_text(text)
    return str(path)


def test_flag_beats_environment_beats_file_beats_default(tmp_path: Path) -> None:
    path = _file(tmp_path, 'flush-interval-ms = 7\nheartbeat_interval_ms = 300\ngrace-ms = 40\nlog-level = "DEBUG"\n')
    env = {"RINGQ_HEARTBEAT_INTERVAL_MS": "500", "RINGQ_GRACE_MS": "60"}
    args = config.parse(node_parser(), [*REQUIRED, "--config", path, "--grace-ms", "80"], env)
    assert args.flush_interval_ms == 0.007  # the file
    assert args.heartbeat_interval_ms == 0.5  # the environment over the file
    assert args.grace_ms == 0.08  # the flag over both
    assert args.log_level == "DEBUG"
    assert args.failure_timeout_ms == 2.0  # the default
    # Required settings may come from the file or the environment, and --config from RINGQ_CONFIG.
    only_file = _file(tmp_path, 'id = "node7"\ncoordinator = "127.0.0.1:7000"\n')
    args = config.parse(node_parser(), [], {"RINGQ_CONFIG": only_file, "RINGQ_LISTEN": "127.0.0.1:0"})
    assert (args.id, args.listen) == ("node7", "127.0.0.1:0")


@pytest.mark.parametrize(
    ("text", "env", "says"),
    [
        ("flush-intervl-ms = 5\n", {}, "key 'flush-intervl-ms': no such setting (did you mean 'flush-interval-ms'?)"),
        ("flush-interval-ms = 0\n", {}, "key 'flush-interval-ms': expected 0 < milliseconds"),
        ('log-level = "LOUD"\n', {}, "key 'log-level': must be one of DEBUG, INFO, WARNING, ERROR, got 'LOUD'"),
        ("listen = [1, 2]\n", {}, "key 'listen': expected a string or a number"),
        ("listen = true\n", {}, "key 'listen': expected a value, got true"),
        ("this is not toml\n", {}, "not valid TOML"),
        ("", {"RINGQ_FAILURE_TIMEOUT_MS": "soon"}, "$RINGQ_FAILURE_TIMEOUT_MS: expected milliseconds, got 'soon'"),
    ],
)
def test_a_bad_setting_is_one_line_naming_its_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, env: dict[str, str], says: str
) -> None:
    path = _file(tmp_path, text)
    with pytest.raises(SystemExit) as exited:
        config.parse(node_parser(), [*REQUIRED, "--config", path], env)
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and says in error, error


def test_a_missing_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        config.parse(node_parser(), [*REQUIRED, "--config", str(tmp_path / "absent.toml")], {})
    assert "absent.toml: cannot read it" in capsys.readouterr().err


def test_variables_that_name_no_setting_are_left_to_other_programs() -> None:
    args = config.parse(node_parser(), REQUIRED, {"RINGQ_NODE": "x:1", "RINGQ_DEFAULT_PASSWORD": "p"})
    assert args.id == "node1"


def test_the_coordinator_reads_the_same_layers(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    path = _file(tmp_path, 'store = "zookeeper"\n')
    env = {**os.environ, "RINGQ_LISTEN": "127.0.0.1:99999"}
    done = subprocess.run(
        [sys.executable, "-m", "services.coordinator", "--config", path],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert done.returncode == 2
    assert "$RINGQ_LISTEN: port must be between 0 and 65535, got 99999" in done.stderr, done.stderr
