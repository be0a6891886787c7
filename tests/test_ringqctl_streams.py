"""`ringqctl`'s stream commands without a cluster: parsing, the requests they send, the tables and --json.

declare_stream, delete_stream, stream_status and list_streams are run through `ringq.ctl.main` with
`Nodes.stream_call` replaced by a stand-in that records each request and answers with a canned
StreamInfo; tests/test_integration_ringqctl_streams.py runs them against a live cluster.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from ringq import ctl, ctl_output
from ringq.v1 import stream_pb2

STALLED = (
    "stalled: the head of the consume list, group stream/orders/1, has no replica that can be reached; "
    "consumers wait for one to come back with its log and never skip ahead to later groups"
)


def stalled_stream() -> stream_pb2.StreamInfo:
    """A stream whose head consume group lost both replicas, with a producer holding its lease."""
    return stream_pb2.StreamInfo(
        stream=stream_pb2.StreamRef(vhost="/", stream="orders"),
        durable=True,
        send_list=["stream/orders/2", "stream/orders/3"],
        consume_list=["stream/orders/1", "stream/orders/2"],
        groups=[
            stream_pb2.StreamGroupInfo(
                group="stream/orders/1",
                depth=-1,
                whole=False,
                state="down: both replicas unreachable; takes no sends until both replicas are back",
                generation=1,
            ),
            stream_pb2.StreamGroupInfo(
                group="stream/orders/2",
                master_node="node2",
                mirrors=["node3"],
                synchronised_mirrors=["node3"],
                depth=120,
                whole=True,
                state="sending",
                generation=2,
            ),
            stream_pb2.StreamGroupInfo(
                group="stream/orders/3",
                master_node="node4",
                mirrors=["node1"],
                depth=0,
                whole=True,
                state="ready: may take sends",
            ),
        ],
        leases=[
            stream_pb2.StreamLease(
                role=stream_pb2.STREAM_ROLE_PRODUCER, holder="app.1a2b3c4d", fencing_token=3, expires_in_ms=2400
            ),
            stream_pb2.StreamLease(role=stream_pb2.STREAM_ROLE_CONSUMER, fencing_token=2),
        ],
        consume_state=STALLED,
    )


def flowing_stream() -> stream_pb2.StreamInfo:
    """A transient stream of vhost "v", freshly declared: nothing waits, no lease held."""
    return stream_pb2.StreamInfo(
        stream=stream_pb2.StreamRef(vhost="v", stream="events"),
        durable=False,
        send_list=["stream/events/1", "stream/events/2"],
        groups=[
            stream_pb2.StreamGroupInfo(
                group=f"stream/events/{n}",
                master_node=f"node{n}",
                mirrors=[f"node{n + 1}"],
                synchronised_mirrors=[f"node{n + 1}"],
                whole=True,
                state="sending" if n == 1 else "ready: may take sends",
            )
            for n in (1, 2)
        ],
        leases=[
            stream_pb2.StreamLease(role=stream_pb2.STREAM_ROLE_PRODUCER),
            stream_pb2.StreamLease(
                role=stream_pb2.STREAM_ROLE_CONSUMER, holder="reader.9f", fencing_token=1, expires_in_ms=0
            ),
        ],
    )


def rows(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines()]


class StreamService:
    """Stands in for the nodes' StreamService: records (method, request, idempotent), answers with `info`."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, bool]] = []
        self.info = stalled_stream()

    def answer(self, method: str, request: Any) -> Any:
        if method == "DeclareStream":
            return stream_pb2.DeclareStreamResponse(stream=self.info)
        if method == "DeleteStream":
            return stream_pb2.DeleteStreamResponse()
        if method == "StreamStatus":
            return stream_pb2.StreamStatusResponse(stream=self.info)
        assert method == "ListStreams"
        return stream_pb2.ListStreamsResponse(streams=[self.info, flowing_stream()])


class MethodName:
    """What `lambda s: s.DeclareStream` returns when given this as the stub: the method's name."""

    def __getattr__(self, name: str) -> str:
        return name


@pytest.fixture
def service(monkeypatch: pytest.MonkeyPatch) -> StreamService:
    stand_in = StreamService()

    def stream_call(nodes: ctl.Nodes, method: Callable[[Any], Any], request: Any, idempotent: bool = False) -> Any:
        name = method(MethodName())
        stand_in.calls.append((name, request, idempotent))
        return stand_in.answer(name, request)

    monkeypatch.setattr(ctl.Nodes, "stream_call", stream_call)
    return stand_in


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert ctl.main(["--node", "127.0.0.1:1", *argv]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


# ------------------------------------------------------------------------------------------ parsing


def test_declare_stream_defaults_to_three_durable_groups_in_vhost_slash() -> None:
    args = ctl.parser().parse_args(["declare_stream", "orders"])
    assert (args.name, args.vhost, args.groups, args.transient) == ("orders", "/", 3, False)
    assert args.run is ctl.declare_stream


def test_declare_stream_options_and_global_options_after_the_command() -> None:
    args = ctl.parser().parse_args(["declare_stream", "-p", "v", "orders", "--groups", "5", "--transient", "--json"])
    assert (args.name, args.vhost, args.groups, args.transient, args.json) == ("orders", "v", 5, True, True)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["declare_stream", "s", "--groups", "1"], "argument --groups: 1: a stream has 2 to 64 groups"),
        (["declare_stream", "s", "--groups", "65"], "argument --groups: 65: a stream has 2 to 64 groups"),
        (["declare_stream", "s", "--groups", "three"], "argument --groups: 'three' is not a number"),
        (["declare_stream"], "the following arguments are required: name"),
        (["stream_status"], "the following arguments are required: name"),
        (["delete_stream"], "the following arguments are required: name"),
        (["list_streams", "extra"], "unrecognized arguments: extra"),
    ],
)
def test_bad_usage_exits_2_with_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exited:
        ctl.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err == f"ringqctl: error: {message}\n"


def test_every_stream_verb_has_help() -> None:
    help_text = ctl.parser().format_help()
    for verb in ("declare_stream", "delete_stream", "stream_status", "list_streams"):
        assert verb in help_text


# ------------------------------------------------------------------------------------------ requests sent


def test_requests_name_the_stream_and_vhost(service: StreamService, capsys: pytest.CaptureFixture[str]) -> None:
    run(capsys, "declare_stream", "orders")
    run(capsys, "declare_stream", "-p", "v", "events", "--groups", "2", "--transient")
    run(capsys, "stream_status", "orders")
    run(capsys, "delete_stream", "-p", "v", "events")
    run(capsys, "list_streams")
    run(capsys, "list_streams", "-p", "v")
    orders = stream_pb2.StreamRef(vhost="/", stream="orders")
    events = stream_pb2.StreamRef(vhost="v", stream="events")
    assert service.calls == [
        ("DeclareStream", stream_pb2.DeclareStreamRequest(stream=orders, groups=3, durable=True), True),
        ("DeclareStream", stream_pb2.DeclareStreamRequest(stream=events, groups=2, durable=False), True),
        ("StreamStatus", stream_pb2.StreamStatusRequest(stream=orders), True),
        ("DeleteStream", stream_pb2.DeleteStreamRequest(stream=events), False),
        ("ListStreams", stream_pb2.ListStreamsRequest(vhost=""), True),
        ("ListStreams", stream_pb2.ListStreamsRequest(vhost="v"), True),
    ]


# ------------------------------------------------------------------------------------------ output


def test_stream_status_text_puts_why_consumption_waits_first(
    service: StreamService, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = run(capsys, "stream_status", "orders").splitlines()
    assert lines[0] == "stream 'orders' in vhost '/': durable, 3 groups"
    assert lines[1] == f"CONSUMPTION WAITS: {STALLED}"
    assert lines[2].split(None, 2) == ["send", "list", "stream/orders/2, stream/orders/3"]
    assert lines[3].split(None, 2) == ["consume", "list", "stream/orders/1, stream/orders/2"]
    groups = rows("\n".join(lines[5:9]))
    assert groups[0] == ["group", "master", "mirrors", "synchronised", "depth", "whole", "generation", "state"]
    assert groups[1][:7] == ["stream/orders/1", "-", "-", "-", "unknown", "NO", "1"]
    assert " ".join(groups[1][7:]).startswith("down: both replicas unreachable")
    assert groups[2] == ["stream/orders/2", "node2", "node3", "node3", "120", "yes", "2", "sending"]
    assert groups[3][:7] == ["stream/orders/3", "node4", "node1", "-", "0", "yes", "0"]
    assert rows("\n".join(lines[10:])) == [
        ["lease", "holder", "fencing", "token", "expires", "in"],
        ["producer", "app.1a2b3c4d", "3", "2.4s"],
        ["consumer", "-", "(free)", "2", "-"],
    ]


def test_a_stream_that_does_not_wait_says_so() -> None:
    lines = ctl_output.stream_text(flowing_stream()).splitlines()
    assert lines[:4] == [
        "stream 'events' in vhost 'v': transient, 2 groups",
        "consumption: not waiting",
        "send list     stream/events/1, stream/events/2",
        "consume list  - (nothing to consume)",
    ]
    assert ["consumer", "reader.9f", "1", "expired"] in rows("\n".join(lines))


def test_empty_send_list_is_explained() -> None:
    info = flowing_stream()
    del info.send_list[:]
    assert "send list     - (no group may take sends)" in ctl_output.stream_text(info).splitlines()


def test_list_streams_table(service: StreamService, capsys: pytest.CaptureFixture[str]) -> None:
    header, orders, events = run(capsys, "list_streams").splitlines()
    assert header.split() == [
        "vhost", "name", "durable", "groups", "send", "head", "consume", "list", "depth",
        "producer", "consumer", "consume", "state",
    ]  # fmt: skip
    assert orders.split()[:10] == [
        "/", "orders", "yes", "3", "stream/orders/2", "stream/orders/1,stream/orders/2", "120+?",
        "app.1a2b3c4d#3", "-", "stalled:",
    ]  # fmt: skip
    assert orders.endswith(STALLED)
    assert events.split() == ["v", "events", "no", "2", "stream/events/1", "-", "0", "-", "reader.9f#1", "-"]


def test_declare_and_delete_say_what_they_did(service: StreamService, capsys: pytest.CaptureFixture[str]) -> None:
    declared = run(capsys, "declare_stream", "orders").splitlines()
    assert declared[0] == "stream 'orders' declared in vhost '/'"
    assert declared[1:] == ctl_output.stream_text(stalled_stream()).splitlines()
    deleted = run(capsys, "delete_stream", "orders")
    assert deleted == "stream 'orders' deleted from vhost '/', with its groups and their messages\n"


def test_json_is_protobufs_mapping(service: StreamService, capsys: pytest.CaptureFixture[str]) -> None:
    status = json.loads(run(capsys, "stream_status", "orders", "--json"))
    assert status["stream"] == {"vhost": "/", "stream": "orders"}
    assert status["consume_state"] == STALLED
    assert status["send_list"] == ["stream/orders/2", "stream/orders/3"]
    assert status["groups"][0]["depth"] == "-1"  # int64: a string in protobuf's JSON mapping
    assert status["groups"][0]["master_node"] == ""  # fields at their default are printed too
    assert status["leases"][0] == {
        "role": "STREAM_ROLE_PRODUCER",
        "holder": "app.1a2b3c4d",
        "fencing_token": "3",
        "expires_in_ms": "2400",
    }
    assert json.loads(run(capsys, "--json", "declare_stream", "orders")) == status
    listed = json.loads(run(capsys, "list_streams", "--json"))
    assert [s["stream"]["stream"] for s in listed["streams"]] == ["orders", "events"]
    assert listed["streams"][0] == status
    assert json.loads(run(capsys, "delete_stream", "orders", "--json")) == {}


def test_a_refused_call_is_one_line_and_exit_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    class Refused(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.NOT_FOUND

        def details(self) -> str:
            return "no stream 'nope'\n in vhost '/'"

    def stream_call(*_: Any, **__: Any) -> Any:
        raise Refused()

    monkeypatch.setattr(ctl.Nodes, "stream_call", stream_call)
    assert ctl.main(["--node", "127.0.0.1:1", "stream_status", "nope"]) == 1
    out, err = capsys.readouterr()
    assert (out, err) == ("", "ringqctl: NOT_FOUND: no stream 'nope' in vhost '/'\n")
