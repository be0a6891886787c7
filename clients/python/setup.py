"""Builds `ringq` (see pyproject.toml): its version is ringq/_version.py's, its extras name ringq-server at
that version, and its wheel carries ringq.v1, generated from ../../protos."""

import sys
from pathlib import Path

from setuptools import setup

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ringq_build import build_py_generating, version

VERSION = version()

setup(
    version=VERSION,
    extras_require={
        "server": [f"ringq-server=={VERSION}"],
        "pipeline": [f"ringq-server[pipeline]=={VERSION}"],
    },
    cmdclass={"build_py": build_py_generating("ringq.v1")},
)
