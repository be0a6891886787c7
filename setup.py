"""Builds `ringq-server` (see pyproject.toml): its version is ringq's, it depends on ringq at that version
plus [tool.ringq-server] dependencies, and its wheel carries ringq.internal, generated from protos/."""

import sys
import tomllib
from pathlib import Path

from setuptools import setup

sys.path.insert(0, str(Path(__file__).resolve().parent / "clients" / "python"))
from _ringq_build import build_py_generating, version

VERSION = version()
PYPROJECT = tomllib.loads((Path(__file__).resolve().parent / "pyproject.toml").read_text(encoding="utf-8"))

setup(
    version=VERSION,
    install_requires=[f"ringq=={VERSION}", *PYPROJECT["tool"]["ringq-server"]["dependencies"]],
    cmdclass={"build_py": build_py_generating("ringq.internal.v1")},
)
