"""gRPC keepalive for every ringq channel and server: a peer that went silent is noticed.

Responsible for: the one setting of HTTP/2 keepalive shared by the SDK, the nodes, the ring
links and the coordinator. Without it a connection to a host that was cut off (a network
partition drops packets, nothing answers) looks healthy until TCP gives up, which takes
many minutes: a stream waiting for a reply from it, a publish waiting for its confirms,
would wait that long. With it, a channel pings its peer after KEEPALIVE_TIME_MS without
traffic and fails its calls with UNAVAILABLE when no answer comes within
KEEPALIVE_TIMEOUT_MS; the caller then fails over (the SDK to another node).

Servers accept those pings (gRPC servers refuse frequent pings by default, answering with
GOAWAY "too_many_pings").
"""

from __future__ import annotations

from typing import Final

KEEPALIVE_TIME_MS: Final = 2_000
KEEPALIVE_TIMEOUT_MS: Final = 2_000

CHANNEL_KEEPALIVE: Final[list[tuple[str, int]]] = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]

SERVER_KEEPALIVE: Final[list[tuple[str, int]]] = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
]
