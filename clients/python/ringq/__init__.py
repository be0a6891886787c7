"""ringq: the Python SDK of the ringq broker.

`ringq.Connection` (blocking) and `ringq.aio.Connection` (asyncio) give
producers with confirms, consumers with acks, and queue administration, and
ordered streams (`StreamProducer` / `StreamConsumer`, `StreamStatus`: ringq.streams);
`ringq.Admin` / `ringq.aio.Admin` manage policies and the cluster through the
coordinator. Results are `ringq.models` dataclasses, failures
`ringq.errors.RingqError`s. `ringq.v1` holds the code generated from protos/.
"""

from ringq import (
    _fork_safety,  # noqa: F401  (first: before anything imports grpc)
    _grpc_io,  # noqa: F401  (first too: gRPC's I/O path is chosen before grpc loads)
    errors,
    models,
)
from ringq._version import __version__ as __version__
from ringq.aio import Delivery, Outcome
from ringq.blocking import Admin, Connection, Consumer, Producer, StreamConsumer, StreamProducer
from ringq.errors import RingqError
from ringq.security import TLS, Credentials
from ringq.streams import StreamGroup, StreamLeaseInfo, StreamMessage, StreamStatus

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
    "StreamConsumer",
    "StreamGroup",
    "StreamLeaseInfo",
    "StreamMessage",
    "StreamProducer",
    "StreamStatus",
    "errors",
    "models",
]
