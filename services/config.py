"""Settings for a process from three places besides its flags: a TOML file and RINGQ_* environment variables.

Responsible for: one precedence for every flag of a node and of a coordinator,

    flag  >  environment (RINGQ_FLAG_NAME)  >  file (--config FILE, key flag-name)  >  default

and a clear error naming the bad key or variable. A flag `--flush-interval-ms` is the file key
`flush-interval-ms` (or `flush_interval_ms`) and the variable `RINGQ_FLUSH_INTERVAL_MS`. File values may
be TOML strings, integers or booleans (a switch: true sets it); lists and tables are refused.
Environment variables that name no flag of the process are ignored (other RINGQ_* variables belong to
other programs: ringqctl's RINGQ_NODE, the coordinator's RINGQ_DEFAULT_PASSWORD).

Guarantees: a value from the file or the environment goes through the same checks as the flag (type,
choices); a bad one exits 2 with one line naming the file and key, or the variable; `--config` itself
may come from RINGQ_CONFIG.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any

ENV_PREFIX = "RINGQ_"
CONFIG = "config"


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="a TOML file of settings, keys named as the flags (flush-interval-ms = 5); "
        f"flags win over {ENV_PREFIX}* variables, which win over the file (docs/configuration.md)",
    )


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None, env: Mapping[str, str] | None = None) -> Any:
    """Parse `argv` (default sys.argv[1:]) with the file and environment layered under it."""
    given = list(sys.argv[1:] if argv is None else argv)
    env = os.environ if env is None else env
    actions = _settable(parser)
    finder = argparse.ArgumentParser(add_help=False)
    finder.add_argument("--config")
    config_path = finder.parse_known_args(given)[0].config or env.get(f"{ENV_PREFIX}CONFIG")
    layered: list[str] = []
    if config_path:
        layered += _from_file(parser, actions, config_path)
    layered += _from_env(parser, actions, env)
    return parser.parse_args([*layered, *given])


def _is_switch(action: argparse.Action) -> bool:
    return action.nargs == 0 and action.const is True  # store_true


def _settable(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The flags a file or variable may set, by dest: every option that takes a value, and switches."""
    return {
        action.dest: action
        for action in parser._actions
        if action.option_strings and action.dest != CONFIG and (action.nargs != 0 or _is_switch(action))
    }


def _from_file(parser: argparse.ArgumentParser, actions: Mapping[str, argparse.Action], path: str) -> list[str]:
    try:
        with open(path, "rb") as file:
            table = tomllib.load(file)
    except OSError as error:
        parser.error(f"--config {path}: cannot read it: {error.strerror}")
    except tomllib.TOMLDecodeError as error:
        parser.error(f"--config {path}: not valid TOML: {error}")
    argv: list[str] = []
    for key, value in table.items():
        dest = key.replace("-", "_")
        where = f"{path}: key {key!r}"
        action = actions.get(dest)
        if action is None:
            known = [name.replace("_", "-") for name in actions]
            close = difflib.get_close_matches(key.replace("_", "-"), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; known keys: {', '.join(sorted(known))}"
            parser.error(f"{where}: no such setting{hint}")
        if isinstance(value, bool):
            if not _is_switch(action):
                parser.error(f"{where}: expected a value, got {str(value).lower()}")
            argv += [action.option_strings[-1]] if value else []
            continue
        if not isinstance(value, str | int | float) or _is_switch(action):
            parser.error(f"{where}: expected {'true or false' if action.nargs == 0 else 'a string or a number'}")
        argv += _checked(parser, action, str(value), where)
    return argv


def _from_env(
    parser: argparse.ArgumentParser, actions: Mapping[str, argparse.Action], env: Mapping[str, str]
) -> list[str]:
    argv: list[str] = []
    for dest, action in actions.items():
        name = f"{ENV_PREFIX}{dest.upper()}"
        if name not in env:
            continue
        value = env[name]
        if _is_switch(action):
            if value.lower() not in ("true", "false", "1", "0", "yes", "no", ""):
                parser.error(f"${name}: expected true or false, got {value!r}")
            argv += [action.option_strings[-1]] if value.lower() in ("true", "1", "yes") else []
            continue
        argv += _checked(parser, action, value, f"${name}")
    return argv


def _checked(parser: argparse.ArgumentParser, action: argparse.Action, value: str, where: str) -> list[str]:
    """`[flag, value]` once `value` passes the flag's own checks; exits 2 naming `where` otherwise."""
    try:
        converted = action.type(value) if callable(action.type) else value
    except (argparse.ArgumentTypeError, TypeError, ValueError) as error:
        parser.error(f"{where}: {error}")
    if action.choices is not None and converted not in action.choices:
        parser.error(f"{where}: must be one of {', '.join(map(str, action.choices))}, got {value!r}")
    return [action.option_strings[-1], value]
