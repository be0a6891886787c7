"""ringq: the Python SDK of the ringq broker.

`ringq.Connection` (blocking) and `ringq.aio.Connection` (asyncio) give
producers with confirms, consumers with acks, and queue administration;
`ringq.Admin` / `ringq.aio.Admin` manage policies and the cluster through the
coordinator. Results are `ringq.models` dataclasses, failures
`ringq.errors.RingqError`s. `ringq.v1` holds the code generated from protos/.
"""

from ringq import errors, models
from ringq._version import __version__ as __version__
from ringq.aio import Delivery, Outcome
from ringq.blocking import Admin, Connection, Consumer, Producer
from ringq.errors import RingqError
from ringq.security import TLS, Credentials

__all__ = [
    "TLS",
    "Admin",
    "Connection",
    "Consumer",
    "Credentials",
    "Delivery",
    "Outcome",
    "Producer",
    "RingqError",
    "errors",
    "models",
]
