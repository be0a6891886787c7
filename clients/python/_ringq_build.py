"""Build support shared by the two distributions of this repository; never installed.

clients/python/setup.py builds `ringq` (the SDK, `ringq.v1` and ringqctl) and setup.py at the root builds
`ringq-server` (nodes, coordinator, the `ringq` command, pipeline/ and `ringq.internal`). Both take their
version from clients/python/ringq/_version.py (`version()`), and both generate their gRPC code from
protos/ while building a wheel (`build_py_generating`), so a wheel built from a clean checkout carries
it: grpcio-tools is a build requirement of both. An editable install (`make setup`) generates nothing:
the Makefile's `make protos` writes the code into the source tree, where the editable install finds it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
VERSION_FILE = HERE / "ringq" / "_version.py"
PROTOS = HERE.parents[1] / "protos"


def version() -> str:
    """`__version__` of clients/python/ringq/_version.py, read without importing ringq."""
    text = VERSION_FILE.read_text(encoding="utf-8")
    found = re.search(r'^__version__ = "([^"]+)"$', text, re.MULTILINE)
    if found is None:
        raise RuntimeError(f'{VERSION_FILE} has no line __version__ = "..."')
    return found.group(1)


def generate(package: str, out: Path) -> None:
    """Generate the Python code of protos/<package as a path>/*.proto (with .pyi stubs) under `out`, with an
    __init__.py in every package below ringq. `package` is "ringq.v1" or "ringq.internal.v1"; the code of
    other protos they import (internal ones import ringq.v1) is the installed ringq's."""
    source = PROTOS / package.replace(".", "/")
    protos = sorted(source.glob("*.proto"))
    if not protos:
        raise RuntimeError(
            f"no .proto files in {source}: build the wheels from a checkout of the ringq repository (make wheels)"
        )
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTOS}"]
    command += [f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}", *map(str, protos)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"protoc failed ({result.returncode}) on {source}:\n{result.stderr}")
    parts = package.split(".")
    for depth in range(2, len(parts) + 1):
        out.joinpath(*parts[:depth], "__init__.py").touch()


def build_py_generating(*packages: str) -> type[build_py]:
    """A build_py command that also generates `packages` (see `generate`) into the build directory, so the
    wheel carries them whatever the source tree holds; in an editable install it generates nothing."""

    class BuildPyGenerating(build_py):
        def run(self) -> None:
            super().run()
            if self.editable_mode:
                return
            for package in packages:
                generate(package, Path(self.build_lib))

    return BuildPyGenerating
