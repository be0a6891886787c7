"""How ringqctl prints: aligned tables for people, protobuf's JSON mapping for scripts."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from google.protobuf import json_format

from ringq.v1 import stream_pb2


def table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=False)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def as_json(message: Any) -> Any:
    return json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


# ------------------------------------------------------------------------------------------ streams
# StreamInfo (protos/ringq/v1/stream.proto) for people: why consumption waits comes first, then the
# send and consume lists, each group's replicas, depth and state, and the leases.

_ROLE_NAMES = {stream_pb2.STREAM_ROLE_PRODUCER: "producer", stream_pb2.STREAM_ROLE_CONSUMER: "consumer"}


def _listed(names: Sequence[str], separator: str = ",") -> str:
    return separator.join(names) or "-"


def consumption_text(consume_state: str) -> str:
    """The stream's consume_state as one line: what stalls consumption, or that nothing does."""
    return f"CONSUMPTION WAITS: {consume_state}" if consume_state else "consumption: not waiting"


def depth_text(depth: int) -> str:
    return "unknown" if depth < 0 else str(depth)


def expiry_text(lease: stream_pb2.StreamLease) -> str:
    """When a StreamLease expires, from when the status was read: "-" when free, "expired" at 0."""
    if not lease.holder:
        return "-"
    return f"{lease.expires_in_ms / 1000:.1f}s" if lease.expires_in_ms else "expired"


def holder_text(lease: stream_pb2.StreamLease) -> str:
    """A StreamLease's holder and token: HOLDER#TOKEN, or "-" when free."""
    return f"{lease.holder}#{lease.fencing_token}" if lease.holder else "-"


def stream_text(info: stream_pb2.StreamInfo) -> str:
    """A StreamInfo: head line, consume state, the two lists, a table of groups and one of leases."""
    head = f"stream {info.stream.stream!r} in vhost {info.stream.vhost or '/'!r}: "
    head += f"{'durable' if info.durable else 'transient'}, {len(info.groups)} groups"
    lists = [  # head first
        ["send list", _listed(info.send_list, ", ") if info.send_list else "- (no group may take sends)"],
        ["consume list", _listed(info.consume_list, ", ") if info.consume_list else "- (nothing to consume)"],
    ]
    width = max(len(key) for key, _ in lists)
    groups = [
        [
            g.group,
            g.master_node or "-",
            _listed(g.mirrors),
            _listed(g.synchronised_mirrors),
            depth_text(g.depth),
            "yes" if g.whole else "NO",
            str(g.generation),
            g.state or "-",
        ]
        for g in info.groups
    ]
    leases = [
        [_ROLE_NAMES.get(lease.role, "?"), lease.holder or "- (free)", str(lease.fencing_token), expiry_text(lease)]
        for lease in info.leases
    ]
    return "\n".join(
        [
            head,
            consumption_text(info.consume_state),
            *(f"{key.ljust(width)}  {value}" for key, value in lists),
            "",
            table(groups, ["group", "master", "mirrors", "synchronised", "depth", "whole", "generation", "state"]),
            "",
            table(leases, ["lease", "holder", "fencing token", "expires in"]),
        ]
    )


def streams_table(streams: Iterable[stream_pb2.StreamInfo]) -> str:
    """StreamInfos, one row each: lists, total depth (known groups; "+?" when a group's is unknown),
    lease holders, and the consume state."""
    rows = []
    for info in streams:
        known = sum(g.depth for g in info.groups if g.depth >= 0)
        unknown = any(g.depth < 0 for g in info.groups)
        holders = {_ROLE_NAMES.get(lease.role, "?"): holder_text(lease) for lease in info.leases}
        rows.append(
            [
                info.stream.vhost or "/",
                info.stream.stream,
                "yes" if info.durable else "no",
                str(len(info.groups)),
                _listed(info.send_list[:1]),
                _listed(info.consume_list),
                f"{known}+?" if unknown else str(known),
                holders.get("producer", "-"),
                holders.get("consumer", "-"),
                info.consume_state or "-",
            ]
        )
    headers = ["vhost", "name", "durable", "groups", "send head", "consume list", "depth"]
    return table(rows, [*headers, "producer", "consumer", "consume state"])
