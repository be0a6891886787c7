"""Which of gRPC's I/O paths a ringq server process uses; imported first, for its effect, before grpc.

A node takes the path the SDK chooses for every process that uses it (ringq/_grpc_io.py, which says what
and why): sockets read and written by gRPC's completion-queue poller thread, not by EventEngine's thread
pool. Importing the `ringq` package makes that choice before it imports grpc; services/node.py and the
gRPC floor benchmark import this module before anything else so that it happens before their own grpc
import. The operator's GRPC_EXPERIMENTS, even an empty one, wins.
"""

from __future__ import annotations

import ringq  # noqa: F401 (its first import, ringq._grpc_io, chooses the I/O path before grpc loads)
