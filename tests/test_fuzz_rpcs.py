"""Fuzz: random and mutated protobufs to every RPC of a live node and coordinator, for a fixed budget
(seeded, so a failure replays). Every answer is OK or a documented status (never UNKNOWN or INTERNAL,
which is what an unhandled exception gives), no process dies, and the node's memory stays bounded.

Requests are built from each method's message descriptor: fields filled with random values of their
type (extreme integers, strings with control characters and path-like names, random bytes), then
serialized as they are, truncated, or with random bytes flipped, inserted or appended; and raw random
bytes. The cluster is one node and its coordinator of its own: the fuzz may delete, drain and mark
anything, the processes must carry on."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor as pb_descriptor
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2

from ringq.internal.v1 import coordinator_pb2, peer_pb2
from ringq.v1 import admin_pb2, group_pb2, queue_pb2, stream_pb2
from services import certs, cluster
from services.tls import Dialer
from tests.clusters import GUEST, live_cluster

pytestmark = pytest.mark.integration
SEED = 20261124
CALLS_PER_METHOD = 100
STREAM_SECONDS = 0.3
# What a broker may answer bad input with; UNKNOWN and INTERNAL mean an unhandled exception.
DOCUMENTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.PERMISSION_DENIED,  # e.g. an application joining a queue's group
    grpc.StatusCode.UNAUTHENTICATED,  # with TLS: credentials that name nobody
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,  # a stream the fuzzer stops waiting for
    grpc.StatusCode.CANCELLED,  # a stream the fuzzer cancels
}
# What grpc.aio's client reports when one of its writes races the server's end of a stream: the status
# is made up on the client side (the server's own answer is lost), so the test judges the server by its
# logs, which show any unhandled exception, instead.
CLIENT_WRITE_RACE = "Internal error from Core"
SERVICES = [
    ("node", queue_pb2.DESCRIPTOR.services_by_name["QueueService"]),
    ("node", stream_pb2.DESCRIPTOR.services_by_name["StreamService"]),
    ("node", group_pb2.DESCRIPTOR.services_by_name["GroupService"]),
    ("cluster", peer_pb2.DESCRIPTOR.services_by_name["PeerService"]),
    ("node", admin_pb2.DESCRIPTOR.services_by_name["AdminService"]),
    ("coordinator", coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"]),
    ("coordinator", admin_pb2.DESCRIPTOR.services_by_name["AdminService"]),
    # The health service, on every port, answers anyone (services/health.py).
    *((role, health_pb2.DESCRIPTOR.services_by_name["Health"]) for role in ("node", "cluster", "coordinator")),
]
# Methods fuzzed with fewer calls: a health Watch that parses stays open until its deadline (STREAM_SECONDS
# a call), and its request is Check's, which gets the full budget.
FEWER_CALLS = {"/grpc.health.v1.Health/Watch": 5}
STRINGS = ["", "/", "..", "../../etc", "q", "ha.q", "a\x00b", "\n", "\u202e", "x" * 300, "é" * 200, "node1", "queue.x"]
INTEGERS = [0, 1, -1, 2**31 - 1, -(2**31), 2**32 - 1, 2**63 - 1, -(2**63), 2**64 - 1]
FD = pb_descriptor.FieldDescriptor


def _value(rng: random.Random, field: pb_descriptor.FieldDescriptor, depth: int) -> Any:
    kind = field.type
    if kind == FD.TYPE_MESSAGE:
        assert field.message_type is not None
        return _message(rng, field.message_type, depth + 1)
    if kind == FD.TYPE_STRING:
        return rng.choice(STRINGS) if rng.random() < 0.8 else rng.randbytes(rng.randint(0, 20)).decode("latin-1")
    if kind == FD.TYPE_BYTES:
        return rng.randbytes(rng.choice([0, 1, 16, 1000]))
    if kind == FD.TYPE_BOOL:
        return rng.random() < 0.5
    if kind == FD.TYPE_ENUM:
        assert field.enum_type is not None
        return rng.choice([v.number for v in field.enum_type.values] + [99])
    if kind in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        return rng.choice([0.0, -1.0, 1e300, float("nan")])
    unsigned = kind in (FD.TYPE_UINT32, FD.TYPE_UINT64, FD.TYPE_FIXED32, FD.TYPE_FIXED64)
    bits = 32 if kind in (FD.TYPE_INT32, FD.TYPE_UINT32, FD.TYPE_SINT32, FD.TYPE_FIXED32, FD.TYPE_SFIXED32) else 64
    low, high = (0, 2**bits - 1) if unsigned else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return rng.choice([v for v in INTEGERS if low <= v <= high])


def _message(rng: random.Random, message_type: pb_descriptor.Descriptor, depth: int = 0) -> Any:
    message = message_factory.GetMessageClass(message_type)()
    if depth > 3:
        return message
    for field in message_type.fields:
        if rng.random() < 0.4:
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            entries = getattr(message, field.name)
            key_field, value_field = (
                field.message_type.fields_by_name["key"],
                field.message_type.fields_by_name["value"],
            )
            for _ in range(rng.randint(0, 3)):
                key = _value(rng, key_field, depth)
                if value_field.type == FD.TYPE_MESSAGE:
                    entries[key].CopyFrom(_value(rng, value_field, depth))
                else:
                    entries[key] = _value(rng, value_field, depth)
        elif field.is_repeated:
            for _ in range(rng.randint(0, 3)):
                value = _value(rng, field, depth)
                if field.type == FD.TYPE_MESSAGE:
                    getattr(message, field.name).add().CopyFrom(value)
                else:
                    getattr(message, field.name).append(value)
        elif field.type == FD.TYPE_MESSAGE:
            getattr(message, field.name).CopyFrom(_value(rng, field, depth))
        else:
            setattr(message, field.name, _value(rng, field, depth))
    return message


def _request_bytes(rng: random.Random, message_type: pb_descriptor.Descriptor) -> bytes:
    choice = rng.random()
    if choice < 0.15:
        return rng.randbytes(rng.randint(0, 64))
    data = bytearray(_message(rng, message_type).SerializeToString())
    if choice < 0.6 or not data:
        return bytes(data)
    mutation = rng.choice(["truncate", "flip", "insert", "append"])
    if mutation == "truncate":
        return bytes(data[: rng.randrange(len(data))])
    if mutation == "flip":
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    if mutation == "insert":
        at = rng.randrange(len(data) + 1)
        return bytes(data[:at] + rng.randbytes(rng.randint(1, 8)) + data[at:])
    return bytes(data + rng.randbytes(rng.randint(1, 16)))


async def _call(
    channel: grpc.aio.Channel, service: str, method: pb_descriptor.MethodDescriptor, requests: list[bytes]
) -> grpc.StatusCode:
    path = f"/{service}/{method.name}"
    try:
        if not method.client_streaming and not method.server_streaming:
            await channel.unary_unary(path, None, None)(requests[0], timeout=5)
        elif not method.client_streaming:
            call = channel.unary_stream(path, None, None)(requests[0], timeout=STREAM_SECONDS)
            async for _ in call:
                pass
        else:
            return await _stream(channel.stream_stream(path, None, None)(None, timeout=STREAM_SECONDS), requests)
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


async def _stream(call: Any, requests: list[bytes]) -> grpc.StatusCode:
    """Write `requests` until the server ends the call, then its status (a write racing the server's
    end fails on our side, which says nothing of what the server answered)."""
    for request in requests:
        try:
            await call.write(request)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            break
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
        await call.done_writing()
    with contextlib.suppress(grpc.aio.AioRpcError):
        async for _ in call:
            pass
    code: grpc.StatusCode = await call.code()
    if code == grpc.StatusCode.INTERNAL and await call.details() == CLIENT_WRITE_RACE:
        return grpc.StatusCode.CANCELLED  # ours, not the server's: the server's logs are checked instead
    return code


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.fixture(scope="module", params=["plaintext", "tls"])
def target(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[cluster.ClusterInfo]:
    """A one-node cluster, plaintext or with TLS and authentication on (every call then fuzzed as guest on the
    client port, and as node9, a member of the cluster CA that runs no node, on the internal ports)."""
    with live_cluster(tmp_path_factory.mktemp("fuzz") / "cluster", {}, nodes=1, tls=request.param == "tls") as info:
        yield info


class _AsGuest(grpc.AuthMetadataPlugin):
    def __call__(self, context: grpc.AuthMetadataContext, callback: grpc.AuthMetadataPluginCallback) -> None:
        callback(GUEST.metadata(), None)


async def _channels(target: cluster.ClusterInfo) -> dict[str, grpc.aio.Channel]:
    """A channel for each role of SERVICES: the node's client port, its cluster port, the coordinator."""
    node = target.nodes[0]
    if not target.tls:
        return {role: grpc.aio.insecure_channel(node.address) for role in ("node", "cluster")} | {
            "coordinator": grpc.aio.insecure_channel(target.coordinator.address)
        }
    ca = certs.ca_paths(target.tls_dir).certificate.read_bytes()
    as_guest = grpc.metadata_call_credentials(_AsGuest())  # every call authenticated as guest
    client = grpc.composite_channel_credentials(grpc.ssl_channel_credentials(ca), as_guest)
    certs.issue_node(target.tls_dir, "node9")
    member = Dialer(certs.load_node(target.tls_dir, "node9"))
    coordinator = member.to_coordinator(target.coordinator.address)
    listed = await coordinator.unary_unary(
        "/ringq.internal.v1.CoordinatorService/ListNodes",
        coordinator_pb2.ListNodesRequest.SerializeToString,
        coordinator_pb2.ListNodesResponse.FromString,
    )(coordinator_pb2.ListNodesRequest(), timeout=10)
    (record,) = listed.nodes
    return {
        "node": grpc.aio.secure_channel(node.address, client),
        "cluster": member.to_node(node.name, record.cluster_address),
        "coordinator": coordinator,
    }


def test_random_and_mutated_requests_to_every_rpc_get_documented_statuses(target: cluster.ClusterInfo) -> None:
    rng = random.Random(SEED)
    node = target.nodes[0]
    rss_before = _rss_kib(node.pid)

    async def scenario() -> tuple[list[str], dict[str, set[grpc.StatusCode]]]:
        undocumented: list[str] = []
        answered: dict[str, set[grpc.StatusCode]] = {}
        channels = await _channels(target)
        try:
            for role, service in SERVICES:
                for method in service.methods:
                    calls = FEWER_CALLS.get(f"/{service.full_name}/{method.name}", CALLS_PER_METHOD)
                    for attempt in range(calls):
                        requests = [_request_bytes(rng, method.input_type) for _ in range(rng.randint(1, 4))]
                        code = await _call(channels[role], service.full_name, method, requests)
                        answered.setdefault(role, set()).add(code)
                        if code not in DOCUMENTED:
                            undocumented.append(f"{service.name}.{method.name} #{attempt}: {code.name}")
        finally:
            for channel in channels.values():
                await channel.close(None)
        return undocumented, answered

    undocumented, answered = asyncio.run(scenario())
    no_answer = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
    for role, codes in answered.items():  # the servers were reached (a failed TLS handshake answers nothing)
        assert codes - no_answer, f"{role}: no call was answered: {sorted(c.name for c in codes)}"
    assert not undocumented, f"{len(undocumented)} undocumented statuses, e.g. {undocumented[:10]}"
    for process in target.processes:
        log = (target.logs / f"{process.name}.log").read_text(errors="replace")
        for sign in ("Traceback", "raised by servicer method", "Exception calling application"):
            assert sign not in log, (
                f"{process.name} logged an unhandled exception: {log[log.index(sign) - 500 :][:3000]}"
            )
    for process in target.processes:
        assert cluster.is_alive(process), f"{process.name} died"
    grown_mib = (_rss_kib(node.pid) - rss_before) / 1024
    assert grown_mib < 200, f"the node grew by {grown_mib:.0f} MiB"
