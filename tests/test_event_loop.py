"""The event loop a node runs on (services/event_loop.py, `--event-loop`): uvloop by default, asyncio on
request; gRPC's asyncio streams work on both; a node started with the defaults runs on uvloop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import uvloop

from services import cluster, config, event_loop
from services.node import parser
from tests.clusters import NODE_ARGS

ECHO = "/ringq.test.Echo/Stream"


async def _loop_type() -> type[asyncio.AbstractEventLoop]:
    return type(asyncio.get_running_loop())


def test_uvloop_is_the_default() -> None:
    assert event_loop.DEFAULT_EVENT_LOOP == event_loop.UVLOOP
    assert event_loop.run(_loop_type()) is uvloop.Loop


def test_asyncio_runs_the_standard_librarys_loop() -> None:
    loop_type = event_loop.run(_loop_type(), event_loop.ASYNCIO)
    assert loop_type is not uvloop.Loop
    assert issubclass(loop_type, asyncio.BaseEventLoop)


def test_an_unknown_loop_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown event loop 'tornado'; choose one of uvloop, asyncio"):
        event_loop.loop_factory("tornado")


def test_the_node_setting_defaults_to_uvloop_and_takes_the_flag_and_the_variable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    required = ["--id", "node1", "--coordinator", "127.0.0.1:7000"]
    assert config.parse(parser("ringq node"), required, env={}).event_loop == "uvloop"
    assert config.parse(parser("ringq node"), [*required, "--event-loop", "asyncio"], env={}).event_loop == "asyncio"
    from_env = config.parse(parser("ringq node"), required, env={"RINGQ_EVENT_LOOP": "asyncio"})
    assert from_env.event_loop == "asyncio"
    with pytest.raises(SystemExit) as exit_info:
        config.parse(parser("ringq node"), [*required, "--event-loop", "tornado"], env={})
    assert exit_info.value.code == 2
    assert "invalid choice: 'tornado'" in capsys.readouterr().err


async def _echo(
    requests: AsyncIterator[bytes], _context: grpc.aio.ServicerContext[bytes, bytes]
) -> AsyncIterator[bytes]:
    async for request in requests:
        yield request


async def _stream_round_trips(count: int) -> list[bytes]:
    """A gRPC asyncio server and client in this loop: `count` messages echoed on one bidirectional stream."""
    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "ringq.test.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(_echo)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stream: Any = channel.stream_stream(ECHO, request_serializer=None, response_deserializer=None)
            call = stream()
            echoed: list[bytes] = []
            for number in range(count):
                await call.write(b"message %d" % number)
                echoed.append(await call.read())
            await call.done_writing()
            return echoed
    finally:
        await server.stop(None)


@pytest.mark.parametrize("kind", event_loop.EVENT_LOOPS)
def test_grpc_asyncio_streams_work_on_either_loop(kind: str) -> None:
    assert event_loop.run(_stream_round_trips(50), kind) == [b"message %d" % n for n in range(50)]


def test_a_node_started_with_the_defaults_runs_on_uvloop(tmp_path: Path) -> None:
    """The node process has uvloop's extension loaded (it is imported only to run on it)."""
    info = cluster.up(1, tmp_path, node_args=NODE_ARGS, tls=False)
    try:
        maps = Path(f"/proc/{info.process('node1').pid}/maps").read_text()
    finally:
        cluster.down(tmp_path)
    assert "uvloop/loop." in maps
