"""The version of ringq: the one place it is written.

Both distributions built from this repository take it (clients/python/setup.py for `ringq`, setup.py
for `ringq-server`, which pin each other to it), and so do `ringq.__version__`, `ringqctl --version`
and `ringq --version`; clients/node/package.json carries the same (tests/test_wheel.py checks).
"""

__version__ = "0.2.0"
