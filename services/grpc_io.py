"""Which of gRPC's I/O paths a ringq server process uses; imported for its effect, before grpc.

Responsible for: choosing, before gRPC's C core loads, that a node's sockets are read and written
by the thread that polls gRPC's completion queue (the iomgr path), not by the thread pool of gRPC's
EventEngine, which is the default from grpcio 1.5x on Linux. On the EventEngine path every read
and write crosses one more thread (EventEngine thread, then the completion-queue poller, then the
asyncio loop); a ring hop and a publish each pay for it. Measured with `make bench`'s W2 at 2,000
msgs/s, default settings (docs/benchmarks.md): the three nodes used about 9 % less CPU and their
p50 latency fell by about 0.4 ms.

Guarantees: only sets what the operator did not (an existing GRPC_EXPERIMENTS wins, so
`GRPC_EXPERIMENTS=` restores gRPC's defaults); has no effect once grpc is imported, hence the
import order in services/node.py. A gRPC that no longer knows these experiments logs
"Unknown experiment" once and runs its default path: slower, never incorrect.
"""

from __future__ import annotations

import os

# gRPC's experiment names (GRPC_EXPERIMENTS, a comma-separated list; "-name" turns one off).
POLLER_IO_EXPERIMENTS = "-event_engine_client,-event_engine_listener"


def prefer_poller_io(environ: os._Environ[str] | dict[str, str] = os.environ) -> None:
    """Turn gRPC's EventEngine endpoints off for this process unless GRPC_EXPERIMENTS is set."""
    environ.setdefault("GRPC_EXPERIMENTS", POLLER_IO_EXPERIMENTS)


prefer_poller_io()
