"""services/health.py and services/health_probe.py in one process: the status a Health reports (NOT_SERVING
from the start, every service name as the process, for good once shutting down), List, the plaintext
health port, and the probe's exit codes and one-line reasons."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services import health_probe
from services.health import NOT_SERVING, SERVING, Health
from services.request_guard import HEALTH_METHODS
from tests.zookeeper import free_port

SERVICES = ("ringq.v1.QueueService", "ringq.v1.GroupService")


def test_the_guard_admits_every_method_of_the_health_service() -> None:
    service = health_pb2.DESCRIPTOR.services_by_name["Health"]
    assert {f"/{service.full_name}/{method.name}" for method in service.methods} == HEALTH_METHODS


def test_statuses_through_a_life_and_the_probe(capsys: pytest.CaptureFixture[str]) -> None:
    async def scenario() -> None:
        health = await Health.create(SERVICES)
        server, port = await health.listen("127.0.0.1:0")
        address = f"127.0.0.1:{port}"
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)

                async def statuses() -> dict[str, int]:
                    listed = await stub.List(health_pb2.HealthListRequest(), timeout=5)
                    for name, response in listed.statuses.items():
                        checked = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                        assert checked.status == response.status, name
                    return {name: response.status for name, response in listed.statuses.items()}

                assert await statuses() == dict.fromkeys(("", *SERVICES), NOT_SERVING)
                assert await asyncio.to_thread(health_probe.main, [address]) == 1
                await health.set_serving(True)
                assert await statuses() == dict.fromkeys(("", *SERVICES), SERVING)
                assert await asyncio.to_thread(health_probe.main, [address, "--service", SERVICES[0]]) == 0
                assert await asyncio.to_thread(health_probe.main, [address, "--service", "no.Such"]) == 1
                await health.shutting_down()
                await health.set_serving(True)  # too late: shutting down is for good
                assert await statuses() == dict.fromkeys(("", *SERVICES), NOT_SERVING)
                assert not health.serving
                assert await asyncio.to_thread(health_probe.main, [address]) == 1
        finally:
            await server.stop(None)

    asyncio.run(scenario())
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 3, errors
    assert errors[0].startswith("health_probe: 127.0.0.1:") and errors[0].endswith(" is NOT_SERVING")
    assert "service 'no.Such'" in errors[1] and "NOT_FOUND" in errors[1]
    assert errors[2].endswith(" is NOT_SERVING")


def test_the_probe_says_when_nothing_answers(capsys: pytest.CaptureFixture[str]) -> None:
    address = f"127.0.0.1:{free_port()}"
    assert health_probe.main([address, "--timeout", "0.3"]) == 1
    assert capsys.readouterr().err == f"health_probe: no health service answered at {address} within 0.3 s\n"
    assert health_probe.problem(address, timeout=0.3) is not None
