"""The standard gRPC health service (grpc.health.v1.Health) of a node or a coordinator.

Responsible for: one servicer per process, added to every port the process serves (a node's client,
certificate and cluster ports, a coordinator's port) and, with `--health-listen HOST:PORT`, served alone in
plaintext on a port of its own, for probes that cannot do TLS or present a member certificate (kubelet's
gRPC probe, a compose health check: `python -m services.health_probe`). What the status means is the
process's to say: a node is SERVING once registered and joined to its queues' groups, and not while it
drains (services/node.py); a coordinator while it can reach its store (services/coordinator/server.py).

Guarantees: every service name answers the overall status (service ""); NOT_SERVING from the start until
the process says otherwise, and for good once `shutting_down` ran (a signal was received). The service
needs no credentials on any port (services/request_guard.py lets its methods past the cluster ports'
member check; the access guard is never asked): like RabbitMQ's health checks, it reveals only
SERVING or NOT_SERVING.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.request_guard import SERVER_OPTIONS as GUARDED_SERVER_OPTIONS
from services.request_guard import RequestGuard

log = logging.getLogger("ringq.health")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _Servicer(health.aio.HealthServicer):  # type: ignore[misc,name-defined]  # health.aio is not re-exported
    """grpc's asyncio servicer (Check, Watch), with List, which the protocol gained after it."""

    def __init__(self, statuses: Callable[[], dict[str, int]]) -> None:
        super().__init__()
        self._statuses = statuses

    async def List(self, request: Any, context: Any) -> health_pb2.HealthListResponse:
        statuses = {name: health_pb2.HealthCheckResponse(status=status) for name, status in self._statuses().items()}
        return health_pb2.HealthListResponse(statuses=statuses)


class Health:
    """The health status of a process; `services` are the names of the gRPC services it serves, which
    answer the same as the overall status "". Build it with `await Health.create(...)` (in the loop)."""

    def __init__(self, services: Sequence[str] = ()) -> None:
        self.services = ("", *services)
        self.serving = False
        self.shut_down = False
        self.servicer = _Servicer(lambda: dict.fromkeys(self.services, SERVING if self.serving else NOT_SERVING))

    @classmethod
    async def create(cls, services: Sequence[str] = ()) -> Health:
        """A Health that reports NOT_SERVING (grpc's servicer starts out SERVING)."""
        made = cls(services)
        await made._publish(NOT_SERVING)
        return made

    def add_to(self, server: grpc.aio.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def set_serving(self, serving: bool) -> None:
        """Report SERVING or NOT_SERVING (ignored once shutting down); logs each change."""
        if self.shut_down or serving == self.serving:
            return
        self.serving = serving
        log.info("health: %s", "SERVING" if serving else "NOT_SERVING")
        await self._publish(SERVING if serving else NOT_SERVING)

    async def shutting_down(self) -> None:
        """NOT_SERVING for good (the process received its stop signal)."""
        if not self.shut_down:
            self.serving = False
            self.shut_down = True
            log.info("health: NOT_SERVING (shutting down)")
            await self.servicer.enter_graceful_shutdown()

    async def _publish(self, status: int) -> None:
        for service in self.services:
            await self.servicer.set(service, status)

    async def listen(self, address: str) -> tuple[grpc.aio.Server, int]:
        """Serve this health service alone, in plaintext, at `address` (port 0: any); the started server and
        the port bound, or OSError."""
        server = grpc.aio.server(options=GUARDED_SERVER_OPTIONS, interceptors=[RequestGuard()])
        self.add_to(server)
        try:
            port = server.add_insecure_port(address)
        except RuntimeError as error:  # grpc's way of saying the port is taken
            raise OSError(f"cannot listen on {address} (--health-listen): {error}") from None
        if port == 0:
            raise OSError(f"cannot listen on {address} (--health-listen)")
        await server.start()
        return server, port
