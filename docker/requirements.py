"""Print pinned requirements from pyproject.toml, one a line, for a stage of docker/Dockerfile.

    python docker/requirements.py [--pyproject PATH] [--extra NAME] [--only NAME ...] [--without NAME ...]

The images install ringq with `pip install --no-deps` and its dependencies from this list, so that the
broker image can leave out what only the Spark pipeline needs (pyspark, pandas, pyarrow, matplotlib: about
half a gigabyte, and Java at run time) while every pin stays the one pyproject.toml declares.

`--extra NAME` reads [project.optional-dependencies] NAME instead of [project] dependencies. `--only`
keeps the named requirements, `--without` drops them. A name that is not in the list is an error (exit 2):
when pyproject.toml changes, the image build stops and says which name the Dockerfile must change, rather
than quietly installing something else.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def normalized(name: str) -> str:
    """A distribution name as pip compares them (PEP 503): lower case, runs of -_. as one -."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    """The normalized distribution name at the start of a PEP 508 requirement."""
    match = _NAME.match(requirement.strip())
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return normalized(match.group())


def select(
    pyproject: Path, extra: str | None = None, only: Sequence[str] = (), without: Sequence[str] = ()
) -> list[str]:
    """The requirements of `pyproject` (or of its optional `extra`), kept by `only` and dropped by `without`."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    if extra is None:
        requirements: list[str] = project.get("dependencies", [])
    else:
        extras: dict[str, list[str]] = project.get("optional-dependencies", {})
        if extra not in extras:
            raise ValueError(f"{pyproject} has no optional dependencies {extra!r}")
        requirements = extras[extra]
    names = {requirement_name(r) for r in requirements}
    for name in [*only, *without]:
        if normalized(name) not in names:
            raise ValueError(f"{name!r} is not a requirement in {pyproject} ({', '.join(sorted(names))})")
    kept = {normalized(n) for n in only}
    dropped = {normalized(n) for n in without}
    return [
        r.strip()
        for r in requirements
        if (not kept or requirement_name(r) in kept) and requirement_name(r) not in dropped
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="requirements.py", description=__doc__.splitlines()[0])
    parser.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"))
    parser.add_argument("--extra", help="an optional-dependencies group instead of the dependencies")
    parser.add_argument("--only", nargs="+", default=[], metavar="NAME", help="keep only these")
    parser.add_argument("--without", nargs="+", default=[], metavar="NAME", help="leave these out")
    args = parser.parse_args(argv)
    try:
        lines = select(args.pyproject, args.extra, args.only, args.without)
    except (OSError, KeyError, ValueError, tomllib.TOMLDecodeError) as error:
        print(f"requirements.py: {error}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
