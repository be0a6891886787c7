"""Print pinned requirements from a pyproject.toml, one a line, for a stage of docker/Dockerfile.

    python docker/requirements.py [--pyproject PATH] [--extra NAME] [--only NAME ...] [--without NAME ...]

The images install the wheels of ringq and ringq-server with `pip install --no-deps`, after their
dependencies from these lists (a layer of its own, so a change to the code does not reinstall them), at
the versions the pyproject.toml files pin: clients/python/pyproject.toml (ringq) and pyproject.toml
(ringq-server; the Spark pipeline's dependencies are its extra `pipeline`, which only the pipeline image
installs).

Without `--extra`, the project's dependencies: [project] dependencies, or, where the project lists
"dependencies" as dynamic (ringq-server: its setup.py adds ringq at the version of the build), the
[tool.<project name>] dependencies that setup.py takes them from. `--extra NAME` reads
[project.optional-dependencies] NAME instead. `--only` keeps the named requirements, `--without` drops
them. A name that is not in the list is an error (exit 2): when a pyproject.toml changes, the image build
stops and says which name the Dockerfile must change, rather than quietly installing something else.
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
    document = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    project = document["project"]
    if extra is None and "dependencies" in project.get("dynamic", []):
        requirements: list[str] = document["tool"][project["name"]]["dependencies"]
    elif extra is None:
        requirements = project.get("dependencies", [])
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
