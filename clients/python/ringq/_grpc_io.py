"""Which of gRPC's I/O paths a process that uses ringq takes; imported for its effect, before grpc
(`ringq/__init__.py` imports it first, so `import ringq` before grpc is enough).

Responsible for: choosing, before gRPC's C core loads, that the process's sockets are read and written by
the thread that polls gRPC's completion queue (the iomgr path), not by the thread pool of gRPC's
EventEngine, which is the default from grpcio 1.5x on Linux. On the EventEngine path every read and write
crosses one more thread (an EventEngine thread, then the completion-queue poller, then the caller). The
nodes take this path (services/grpc_io.py): at 2,000 msgs/s it cut their CPU by about 9 % and their p50
latency by about 0.4 ms. In the SDK's producer and consumer (docs/benchmarks.md, nineteenth update, 10
alternations of W2 at 2,000 msgs/s): p50 1.55 -> 1.50 ms, p99 3.11 -> 2.78 ms, the brokers' CPU 0.89 -> 0.85
cores; saturated W2 delivered 51,660 -> 56,140 msgs/s (5 of 5 pairs), W1 unchanged.

Guarantees: only sets what the user did not (an existing GRPC_EXPERIMENTS wins, so `GRPC_EXPERIMENTS=`
restores gRPC's defaults); has no effect once grpc is imported. A gRPC that no longer knows these
experiments logs "Unknown experiment" once and runs its default path: slower, never incorrect.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# gRPC's experiment names (GRPC_EXPERIMENTS, a comma-separated list; "-name" turns one off).
POLLER_IO_EXPERIMENTS = "-event_engine_client,-event_engine_listener"


def prefer_poller_io(environ: MutableMapping[str, str] = os.environ) -> None:
    """Turn gRPC's EventEngine endpoints off for this process unless GRPC_EXPERIMENTS is set."""
    environ.setdefault("GRPC_EXPERIMENTS", POLLER_IO_EXPERIMENTS)


prefer_poller_io()
