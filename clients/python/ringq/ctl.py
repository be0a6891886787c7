"""`ringqctl`: administer a ringq cluster through its broker nodes.

    ringqctl [--node HOST:PORT[,HOST:PORT...]] [--tls-ca PEM [--tls-cert PEM --tls-key PEM]] [--user U --password P]
             [--json] [--timeout S] COMMAND ...       (those options may also come after COMMAND and its arguments)

Cluster commands, sent to a node's AdminService (which answers from the
coordinator): cluster_status, drain_node, undrain_node, forget_node, set_policy,
clear_policy, list_policies, list_leases. Queue commands, sent to a node's
QueueService (which forwards them to the queue's master): declare_queue,
delete_queue, purge_queue, sync_queue, cancel_sync_queue. list_queues and
list_consumers take the queues from AdminService and their depth, consumers
and status from QueueService. Stream commands, sent to a node's StreamService:
declare_stream, delete_stream, list_streams, stream_status (the send and
consume lists, each group's replicas, depth and state, the lease holders, and
why consumption waits if it does). ringqctl never calls the coordinator, whose
port serves only cluster members.

Human tables by default, `--json` for scripts (protobuf's JSON mapping, so
64-bit counts are strings). Errors print one line with the gRPC status and
message and exit 1; usage errors exit 2. Nodes are those of `--node`, else
$RINGQ_NODE, else 127.0.0.1:7100; each is tried in turn on UNAVAILABLE.
`--tls-ca` (or $RINGQ_TLS_CA) reaches them over TLS, trusting that CA; `--user` and
`--password` (or $RINGQ_USER, $RINGQ_PASSWORD) say who acts; or `--tls-cert` and `--tls-key`,
a user certificate, at the nodes' certificate ports. Users, vhosts and permissions:
ringq/ctl_access.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal, NoReturn, TypeVar

import grpc

from ringq import ctl_access
from ringq._version import __version__
from ringq.ctl_output import as_json as _as_json
from ringq.ctl_output import stream_text as _stream_text
from ringq.ctl_output import streams_table as _streams_table
from ringq.ctl_output import table as _table
from ringq.security import TLS, Credentials, authenticated, channel
from ringq.v1 import admin_pb2_grpc, cluster_pb2, queue_pb2, queue_pb2_grpc, stream_pb2, stream_pb2_grpc

DEFAULT_NODE = "127.0.0.1:7100"
NODE_ENV = "RINGQ_NODE"
TLS_CA_ENV = "RINGQ_TLS_CA"
USER_ENV = "RINGQ_USER"
PASSWORD_ENV = "RINGQ_PASSWORD"
T = TypeVar("T")
Req = TypeVar("Req")
Resp = TypeVar("Resp")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"ringqctl: error: {' '.join(message.split())}\n")


class Failure(Exception):
    """A failure found by ringqctl itself, reported like a gRPC status: `ringqctl: CODE: message`."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Admin:
    """AdminService calls on the first node that answers, in the order given."""

    def __init__(
        self,
        addresses: Sequence[str],
        timeout: float = 5.0,
        tls: TLS | None = None,
        credentials: Credentials | None = None,
    ) -> None:
        self.addresses = list(addresses)
        self.timeout = timeout
        self.tls = tls
        self.credentials = credentials

    def call(self, method: Callable[[admin_pb2_grpc.AdminServiceStub], Callable[..., T]], request: Any) -> T:
        last: grpc.RpcError | None = None
        for address in self.addresses:
            with channel(address, self.tls) as open_channel:
                stub = authenticated(admin_pb2_grpc.AdminServiceStub(open_channel), self.credentials)
                try:
                    return method(stub)(request, timeout=self.timeout)
                except grpc.RpcError as error:
                    if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        raise
                    last = error
        assert last is not None
        raise last


class Nodes:
    """QueueService (and StreamService: `stream_call`) calls on broker nodes, each node tried in turn while
    the call fails with UNAVAILABLE.

    `resolve` gives the addresses when first needed. A call that may be repeated safely (`idempotent`)
    also moves on after DEADLINE_EXCEEDED, which is how an address that never answers shows up.
    """

    def __init__(
        self,
        resolve: Callable[[], list[str]],
        timeout: float = 5.0,
        tls: TLS | None = None,
        credentials: Credentials | None = None,
    ) -> None:
        self._resolve = resolve
        self._addresses: list[str] | None = None
        self.timeout = timeout
        self.tls = tls
        self.credentials = credentials
        self._channels: dict[str, grpc.Channel] = {}

    @property
    def addresses(self) -> list[str]:
        if self._addresses is None:
            self._addresses = self._resolve()
        return self._addresses

    def _channel(self, address: str) -> grpc.Channel:
        if address not in self._channels:
            self._channels[address] = channel(address, self.tls)
        return self._channels[address]

    def _stub(self, address: str) -> Any:  # a QueueServiceStub sending the credentials
        return authenticated(queue_pb2_grpc.QueueServiceStub(self._channel(address)), self.credentials)

    def _stream_stub(self, address: str) -> Any:  # a StreamServiceStub sending the credentials
        return authenticated(stream_pb2_grpc.StreamServiceStub(self._channel(address)), self.credentials)

    def stream_call(
        self,
        method: Callable[[stream_pb2_grpc.StreamServiceStub], grpc.UnaryUnaryMultiCallable[Req, Resp]],
        request: Req,
        idempotent: bool = False,
    ) -> Resp:
        """A StreamService call, as `call` (every node serves every stream)."""
        (outcome,) = self._each(self._stream_stub, method, [request], idempotent)
        if isinstance(outcome, grpc.RpcError):
            raise outcome
        return outcome

    def call(
        self,
        method: Callable[[queue_pb2_grpc.QueueServiceStub], grpc.UnaryUnaryMultiCallable[Req, Resp]],
        request: Req,
        idempotent: bool = False,
    ) -> Resp:
        (outcome,) = self.call_each(method, [request], idempotent)
        if isinstance(outcome, grpc.RpcError):
            raise outcome
        return outcome

    def call_each(
        self,
        method: Callable[[queue_pb2_grpc.QueueServiceStub], grpc.UnaryUnaryMultiCallable[Req, Resp]],
        requests: Sequence[Req],
        idempotent: bool = False,
    ) -> list[Resp | grpc.RpcError]:
        """One call per request, all in flight at once; each outcome is the response or the last error."""
        return self._each(self._stub, method, requests, idempotent)

    def _each(
        self,
        stub: Callable[[str], Any],
        method: Callable[[Any], grpc.UnaryUnaryMultiCallable[Req, Resp]],
        requests: Sequence[Req],
        idempotent: bool,
    ) -> list[Resp | grpc.RpcError]:
        retry_on = {grpc.StatusCode.UNAVAILABLE}
        if idempotent:
            retry_on.add(grpc.StatusCode.DEADLINE_EXCEEDED)
        outcomes: list[Resp | grpc.RpcError | None] = [None] * len(requests)
        pending = list(range(len(requests)))
        for address in self.addresses:
            if not pending:
                break
            callable_ = method(stub(address))
            futures = [(i, callable_.future(requests[i], timeout=self.timeout)) for i in pending]
            pending = []
            for i, future in futures:
                try:
                    outcomes[i] = future.result()
                except grpc.RpcError as error:
                    outcomes[i] = error
                    if error.code() in retry_on:
                        pending.append(i)
        done: list[Resp | grpc.RpcError] = []
        for outcome in outcomes:
            assert outcome is not None
            done.append(outcome)
        return done

    def close(self) -> None:
        for open_channel in self._channels.values():
            open_channel.close()
        self._channels.clear()


def _address_problem(address: str) -> str | None:
    host, colon, port = address.rpartition(":")
    if not colon or not host:
        return f"{address!r} is not HOST:PORT"
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"{address!r}: the port must be a number from 1 to 65535"
    return None


def _split_addresses(text: str) -> list[str]:
    return [a.strip() for a in text.split(",") if a.strip()]


@contextmanager
def _nodes(c: Admin, args: argparse.Namespace) -> Iterator[Nodes]:
    given: list[str] = args.nodes
    nodes = Nodes(lambda: list(given), args.timeout, c.tls, c.credentials)
    try:
        yield nodes
    finally:
        nodes.close()


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split())


def _error_text(error: grpc.RpcError) -> str:
    return f"{error.code().name}: {_one_line(error.details())}"


def _definition_text(definition_json: str) -> str:
    try:
        definition = json.loads(definition_json or "{}")
    except ValueError:
        return definition_json
    return " ".join(f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in sorted(definition.items()))


def _names(names: Sequence[str]) -> str:
    return ",".join(names) or "-"


def _info_text(info: queue_pb2.QueueInfo) -> str:
    """A QueueInfo as a two-column table."""
    master = f"{info.master_node} ({info.master_address})" if info.master_address else info.master_node or "-"
    rows = [
        ["master", master],
        ["mirrors", _names(info.mirrors)],
        ["synchronised", _names(info.synchronised_mirrors)],
        ["syncing", _names(info.syncing)],
        ["depth", f"{info.depth} ({info.ready} ready, {info.unacked} unacked)"],
        ["consumers", str(info.consumers)],
        ["policy", info.policy or "-"],
        ["status", info.status or "-"],
    ]
    width = max(len(key) for key, _ in rows)
    return "\n".join(f"{key.ljust(width)}  {value}" for key, value in rows)


def _queue_ref(args: argparse.Namespace) -> queue_pb2.QueueRef:
    return queue_pb2.QueueRef(vhost=args.vhost, queue=args.name)


# ------------------------------------------------------------------------------------ coordinator commands


def _mebibytes(size_bytes: int) -> str:
    return f"{size_bytes // (1024 * 1024)} MiB"


_SizeField = Literal["disk_free_bytes", "disk_free_limit_bytes", "memory_used_bytes", "memory_high_watermark_bytes"]


def _alarm_columns(node: cluster_pb2.NodeRecord, figure: _SizeField, bound: _SizeField, alarm: bool) -> list[str]:
    """A measured figure, its bound (0: "none") and the alarm: "-" for what the node did not report
    (an older node)."""

    def size(field: _SizeField, zero: str) -> str:
        if not node.HasField(field):
            return "-"
        value = getattr(node, field)
        return _mebibytes(value) if value else zero

    return [size(figure, "0 MiB"), size(bound, "none"), "ALARM" if alarm else "no"]


def cluster_status(c: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    status = c.call(lambda s: s.ClusterStatus, cluster_pb2.ClusterStatusRequest())
    now = time.time() * 1000
    rows = [
        [
            n.node,
            n.address,
            "yes" if n.alive else "NO",
            "yes" if n.draining else "no",
            f"{(now - n.last_heartbeat_unix_ms) / 1000:.1f}s ago" if n.last_heartbeat_unix_ms else "never",
            *_alarm_columns(n, "disk_free_bytes", "disk_free_limit_bytes", n.disk_alarm),
            *_alarm_columns(n, "memory_used_bytes", "memory_high_watermark_bytes", n.memory_alarm),
        ]
        for n in status.nodes
    ]
    headers = ["node", "address", "alive", "draining", "last heartbeat", "disk free", "disk limit", "disk alarm"]
    headers += ["memory used", "memory watermark", "memory alarm"]
    text = _table(rows, headers)
    coordinators = ", ".join(f"{e.address} ({'alive' if e.alive else 'not answering'})" for e in status.coordinators)
    text += f"\n\nstore: {status.store_kind}; coordinators: {coordinators or 'none registered'}"
    return _as_json(status), text


def drain_node(c: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    request = cluster_pb2.SetNodeDrainingRequest(node=args.node_id, draining=True)
    response = c.call(lambda s: s.SetNodeDraining, request)
    return _as_json(response), f"node {args.node_id!r} is draining: no new replicas are placed on it"


def undrain_node(c: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    request = cluster_pb2.SetNodeDrainingRequest(node=args.node_id, draining=False)
    response = c.call(lambda s: s.SetNodeDraining, request)
    return _as_json(response), f"node {args.node_id!r} takes new replicas again"


def forget_node(c: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    response = c.call(lambda s: s.ForgetNode, cluster_pb2.ForgetNodeRequest(node=args.node_id))
    deleted = ", ".join(f"{q.name!r} (vhost {q.vhost!r})" for q in response.deleted_queues)
    text = f"node {args.node_id!r} forgotten" + (
        f"; queues that lived only on it deleted: {deleted}" if deleted else ""
    )
    return _as_json(response), text


def set_policy(c: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    policy = cluster_pb2.Policy(
        vhost=args.vhost,
        name=args.name,
        pattern=args.pattern,
        definition_json=args.definition,
        priority=args.priority,
        apply_to=args.apply_to,
    )
    response = c.call(lambda s: s.SetPolicy, cluster_pb2.SetPolicyRequest(policy=policy))
    return _as_json(
        response
    ), f"policy {args.name!r} set in vhost {args.vhost!r}; {response.queues_changed} queue(s) changed"


def clear_policy(c: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    request = cluster_pb2.ClearPolicyRequest(vhost=args.vhost, name=args.name)
    response = c.call(lambda s: s.ClearPolicy, request)
    return _as_json(response), f"policy {args.name!r} cleared; {response.queues_changed} queue(s) changed"


def list_policies(c: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    response = c.call(lambda s: s.ListPolicies, cluster_pb2.ListPoliciesRequest(vhost=args.vhost or ""))
    rows = [
        [p.vhost, p.name, p.pattern, p.apply_to, str(p.priority), _definition_text(p.definition_json)]
        for p in response.policies
    ]
    return _as_json(response), _table(rows, ["vhost", "name", "pattern", "apply-to", "priority", "definition"])


def list_leases(c: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    response = c.call(lambda s: s.ListLeases, cluster_pb2.ListLeasesRequest())
    now = time.time() * 1000
    rows = [
        [
            lease.name,
            lease.holder or "-",
            str(lease.token),
            f"{(lease.expires_at_unix_ms - now) / 1000:.1f}s" if lease.holder else "-",
        ]
        for lease in response.leases
    ]
    return _as_json(response), _table(rows, ["name", "holder", "token", "expires in"])


# ------------------------------------------------------------------------------------------ queue listings


def _statuses(
    c: Admin, args: argparse.Namespace, queues: Sequence[cluster_pb2.QueueRecord]
) -> list[queue_pb2.QueueInfo | str]:
    """QueueStatus of each queue from a node: the QueueInfo, or the error as "CODE: message"."""
    if not queues:
        return []
    with _nodes(c, args) as nodes:
        try:
            outcomes = nodes.call_each(
                lambda s: s.QueueStatus,
                [queue_pb2.QueueStatusRequest(queue=queue_pb2.QueueRef(vhost=q.vhost, queue=q.name)) for q in queues],
                idempotent=True,
            )
        except Failure as failure:  # no node to ask
            return [f"{failure.code.name}: {_one_line(failure.message)}"] * len(queues)
        except grpc.RpcError as error:  # the coordinator did not say which nodes are live
            return [_error_text(error)] * len(queues)
    return [_error_text(o) if isinstance(o, grpc.RpcError) else o.queue for o in outcomes]


def _warn_unanswered(statuses: Sequence[queue_pb2.QueueInfo | str]) -> None:
    errors = [s for s in statuses if isinstance(s, str)]
    if errors:
        print(
            f"ringqctl: warning: no status for {len(errors)} of {len(statuses)} queue(s) (shown as -): {errors[0]}",
            file=sys.stderr,
        )


_STATUS_FIELDS = ("depth", "ready", "unacked", "consumers", "syncing", "status", "events")
# The table shows this many of a queue's most recent events (`--json` shows them all).
_EVENTS_SHOWN = 3


def _recent_events(info: queue_pb2.QueueInfo) -> str:
    """The queue's newest events, newest last, as KIND@NODE (a damaged log, a failed disk...)."""
    return ", ".join(f"{event.kind}@{event.node}" for event in info.events[-_EVENTS_SHOWN:]) or "-"


def list_queues(c: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    response = c.call(lambda s: s.ListQueues, cluster_pb2.ListQueuesRequest(vhost=args.vhost or ""))
    statuses = _statuses(c, args, response.queues)
    rows = []
    entries = []
    for q, info in zip(response.queues, statuses, strict=True):
        entry = _as_json(q)
        if isinstance(info, str):
            entry.update(dict.fromkeys(_STATUS_FIELDS), status_error=info)
            counts = ["-", "-", "-", "-", "-"]
        else:
            shown = _as_json(info)
            entry.update({key: shown.get(key, []) for key in _STATUS_FIELDS}, status_error=None)
            counts = [str(info.depth), str(info.unacked), str(info.consumers), info.status or "-", _recent_events(info)]
        entries.append(entry)
        names = [q.vhost, q.name, q.master, _names(q.mirrors), _names(q.synchronised_mirrors), q.policy or "-"]
        rows.append([*names, *counts])
    _warn_unanswered(statuses)
    headers = [
        "vhost",
        "name",
        "master",
        "mirrors",
        "synchronised",
        "policy",
        "depth",
        "unacked",
        "consumers",
        "status",
        "events",
    ]
    return {"queues": entries}, _table(rows, headers)


def list_consumers(c: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    response = c.call(lambda s: s.ListQueues, cluster_pb2.ListQueuesRequest(vhost=args.vhost or ""))
    statuses = _statuses(c, args, response.queues)
    entries: list[dict[str, Any]] = []
    for q, info in zip(response.queues, statuses, strict=True):
        entries.append(
            {
                "vhost": q.vhost,
                "queue": q.name,
                "consumers": None if isinstance(info, str) else info.consumers,
                "status_error": info if isinstance(info, str) else None,
            }
        )
    _warn_unanswered(statuses)
    rows = [[e["vhost"], e["queue"], "-" if e["consumers"] is None else str(e["consumers"])] for e in entries]
    return {"queues": entries}, _table(rows, ["vhost", "queue", "consumers"])


# ------------------------------------------------------------------------------------------ queue commands


def declare_queue(c: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    request = queue_pb2.DeclareQueueRequest(
        queue=_queue_ref(args), durable=args.durable, auto_delete=args.auto_delete, arguments=dict(args.arguments)
    )
    with _nodes(c, args) as nodes:
        info = nodes.call(lambda s: s.DeclareQueue, request, idempotent=True).queue
    return _as_json(info), f"queue {args.name!r} declared in vhost {args.vhost!r}\n{_info_text(info)}"


def delete_queue(c: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    request = queue_pb2.DeleteQueueRequest(queue=_queue_ref(args), if_unused=args.if_unused, if_empty=args.if_empty)
    with _nodes(c, args) as nodes:
        response = nodes.call(lambda s: s.DeleteQueue, request)
    text = f"queue {args.name!r} deleted from vhost {args.vhost!r}; {response.messages_deleted} message(s) deleted"
    return _as_json(response), text


def purge_queue(c: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    with _nodes(c, args) as nodes:
        response = nodes.call(lambda s: s.PurgeQueue, queue_pb2.PurgeQueueRequest(queue=_queue_ref(args)))
    text = f"queue {args.name!r} in vhost {args.vhost!r} purged; {response.messages_purged} message(s) removed"
    return _as_json(response), text


def sync_queue(c: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    with _nodes(c, args) as nodes:
        request = queue_pb2.SyncQueueRequest(queue=_queue_ref(args))
        info = nodes.call(lambda s: s.SyncQueue, request, idempotent=True).queue
    unsynchronised = [m for m in info.mirrors if m not in info.synchronised_mirrors]
    if unsynchronised:
        head = f"sync of queue {args.name!r} in vhost {args.vhost!r} started for {', '.join(unsynchronised)}"
    else:
        head = f"queue {args.name!r} in vhost {args.vhost!r} has no unsynchronised mirror: nothing to sync"
    return _as_json(info), f"{head}\n{_info_text(info)}"


def cancel_sync_queue(c: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    with _nodes(c, args) as nodes:
        request = queue_pb2.CancelSyncQueueRequest(queue=_queue_ref(args))
        info = nodes.call(lambda s: s.CancelSyncQueue, request, idempotent=True).queue
    return _as_json(info), f"sync of queue {args.name!r} in vhost {args.vhost!r} cancelled\n{_info_text(info)}"


# ------------------------------------------------------------------------------------------ stream commands


def _stream_ref(args: argparse.Namespace) -> stream_pb2.StreamRef:
    return stream_pb2.StreamRef(vhost=args.vhost, stream=args.name)


def declare_stream(c: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    request = stream_pb2.DeclareStreamRequest(stream=_stream_ref(args), groups=args.groups, durable=not args.transient)
    with _nodes(c, args) as nodes:
        info = nodes.stream_call(lambda s: s.DeclareStream, request, idempotent=True).stream
    return _as_json(info), f"stream {args.name!r} declared in vhost {args.vhost!r}\n{_stream_text(info)}"


def delete_stream(c: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    request = stream_pb2.DeleteStreamRequest(stream=_stream_ref(args))
    with _nodes(c, args) as nodes:
        response = nodes.stream_call(lambda s: s.DeleteStream, request)
    text = f"stream {args.name!r} deleted from vhost {args.vhost!r}, with its groups and their messages"
    return _as_json(response), text


def stream_status(c: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    request = stream_pb2.StreamStatusRequest(stream=_stream_ref(args))
    with _nodes(c, args) as nodes:
        info = nodes.stream_call(lambda s: s.StreamStatus, request, idempotent=True).stream
    return _as_json(info), _stream_text(info)


def list_streams(c: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    request = stream_pb2.ListStreamsRequest(vhost=args.vhost or "")
    with _nodes(c, args) as nodes:
        response = nodes.stream_call(lambda s: s.ListStreams, request, idempotent=True)
    return _as_json(response), _streams_table(response.streams)


def _groups(text: str) -> int:
    """--groups: 2 to 64 (the broker's bounds, checked here so a typo is a usage error)."""
    try:
        groups = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 2 <= groups <= 64:
        raise argparse.ArgumentTypeError(f"{groups}: a stream has 2 to 64 groups")
    return groups


# ------------------------------------------------------------------------------------------ command line


def _queue_argument(text: str) -> tuple[str, str]:
    """KEY=JSON for --argument: the key and the JSON text, as given."""
    key, equals, value = text.partition("=")
    if not equals or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=JSON")
    try:
        json.loads(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: the value of {key!r} is not JSON") from None
    return key.strip(), value


def _global_options(parser: argparse.ArgumentParser, *, after_the_command: bool = False) -> None:
    """The options every command takes, before it (`ringqctl --json list_queues`) or, with
    `after_the_command`, after it (`ringqctl list_queues --json`): there they default to nothing, so a value
    given before the command stands unless one is given after it, and a command's own option of the same
    name (list_permissions --user) keeps its meaning there."""
    taken = set(parser._option_string_actions) if after_the_command else set()

    def default(value: object) -> object:
        return argparse.SUPPRESS if after_the_command else value

    def add_argument(flag: str, **options: Any) -> None:
        if flag not in taken:
            parser.add_argument(flag, **options)

    add_argument(
        "--node",
        default=default(None),
        help=f"HOST:PORT of broker nodes, comma-separated, tried in turn (default ${NODE_ENV}, else {DEFAULT_NODE})",
    )
    add_argument(
        "--user",
        dest="auth_user",
        metavar="USER",
        default=default(os.environ.get(USER_ENV) or None),
        help=f"the user to act as (default ${USER_ENV}); with TLS, needed (guest works from loopback only)",
    )
    add_argument(
        "--password",
        dest="auth_password",
        metavar="PASSWORD",
        default=default(os.environ.get(PASSWORD_ENV) or None),
        help=f"its password (default ${PASSWORD_ENV})",
    )
    add_argument(
        "--tls-ca",
        default=default(os.environ.get(TLS_CA_ENV) or None),
        metavar="PEM",
        help=f"reach the nodes over TLS, trusting this CA certificate (default ${TLS_CA_ENV}; none: plaintext)",
    )
    add_argument(
        "--tls-cert",
        metavar="PEM",
        default=default(None),
        help="with --tls-ca: a user certificate to authenticate with (no password)",
    )
    add_argument("--tls-key", metavar="PEM", default=default(None), help="the user certificate's private key")
    add_argument("--json", action="store_true", default=default(False), help="print JSON instead of a table")
    add_argument("--timeout", type=float, default=default(5.0), help="seconds per call (default 5)")


def parser() -> argparse.ArgumentParser:
    out = _Parser(prog="ringqctl", description="Administer a ringq cluster.", allow_abbrev=False)
    out.add_argument("--version", action="version", version=f"ringqctl {__version__}")
    _global_options(out)
    commands = out.add_subparsers(dest="command", required=True, metavar="COMMAND")
    verbs: list[argparse.ArgumentParser] = []

    def command(name: str, run: Callable[[Admin, argparse.Namespace], tuple[Any, str]], text: str) -> Any:
        sub = commands.add_parser(name, help=text, description=text, allow_abbrev=False)
        sub.set_defaults(run=run)
        verbs.append(sub)
        return sub

    command("cluster_status", cluster_status, "nodes, their liveness and disk alarms, coordinators, the store kind")
    for name, run, text in (
        ("drain_node", drain_node, "stop placing new replicas on a node (before taking it down)"),
        ("undrain_node", undrain_node, "place new replicas on a node again"),
        ("forget_node", forget_node, "remove a node that is gone for good, with the queues that lived only on it"),
    ):
        command(name, run, text).add_argument("node_id", metavar="NODE", help="the node's id")
    sub = command("set_policy", set_policy, "create or replace a policy, applied to existing queues at once")
    sub.add_argument("-p", "--vhost", default="/", help="vhost (default /)")
    sub.add_argument("name")
    sub.add_argument("pattern", help="regular expression searched in queue names")
    sub.add_argument("definition", help='JSON object, e.g. \'{"ha-mode":"exactly","ha-params":2}\'')
    sub.add_argument("--priority", type=int, default=0)
    sub.add_argument("--apply-to", default="queues", choices=["queues", "all"])
    sub = command("clear_policy", clear_policy, "delete a policy")
    sub.add_argument("-p", "--vhost", default="/")
    sub.add_argument("name")
    for name, run, text in (
        ("list_policies", list_policies, "list policies"),
        (
            "list_queues",
            list_queues,
            "list queues: master, mirrors, synchronised mirrors, policy; depth, unacked, consumers, status from a node",
        ),
        ("list_consumers", list_consumers, "list queues with their number of consumers (from a node)"),
    ):
        sub = command(name, run, text)
        sub.add_argument("-p", "--vhost", default="", help="only this vhost")
    command("list_leases", list_leases, "list leases: holder, fencing token, expiry")
    ctl_access.add_commands(command)

    def queue_command(name: str, run: Callable[[Admin, argparse.Namespace], tuple[Any, str]], text: str) -> Any:
        sub = command(name, run, text)
        sub.add_argument("-p", "--vhost", default="/", help="vhost (default /)")
        sub.add_argument("name", help="queue name")
        return sub

    sub = queue_command("declare_queue", declare_queue, "declare a queue (placed by its policy), or check it exists")
    sub.add_argument("--durable", action="store_true", help="survives a restart of every node")
    sub.add_argument("--auto-delete", action="store_true", help="deleted with its last consumer")
    sub.add_argument(
        "--argument",
        dest="arguments",
        metavar="KEY=JSON",
        type=_queue_argument,
        action="append",
        default=[],
        help="a queue argument, e.g. x-max-length=10 (repeatable)",
    )
    sub = queue_command("delete_queue", delete_queue, "delete a queue and its messages")
    sub.add_argument("--if-unused", action="store_true", help="refuse if it has consumers")
    sub.add_argument("--if-empty", action="store_true", help="refuse if it holds messages")
    queue_command("purge_queue", purge_queue, "remove every ready message of a queue")
    queue_command("sync_queue", sync_queue, "start syncing a queue's unsynchronised mirrors")
    queue_command("cancel_sync_queue", cancel_sync_queue, "stop syncing a queue's mirrors")

    def stream_command(name: str, run: Callable[[Admin, argparse.Namespace], tuple[Any, str]], text: str) -> Any:
        sub = command(name, run, text)
        sub.add_argument("-p", "--vhost", default="/", help="vhost (default /)")
        sub.add_argument("name", help="stream name")
        return sub

    sub = stream_command(
        "declare_stream", declare_stream, "declare an ordered stream (its groups on distinct nodes), or check it exists"
    )
    sub.add_argument(
        "--groups", type=_groups, default=3, metavar="N", help="broker groups of two replicas each (2 to 64; default 3)"
    )
    sub.add_argument("--transient", action="store_true", help="not durable: its groups do not survive restarts")
    stream_command("delete_stream", delete_stream, "delete a stream, its groups and their messages")
    stream_command(
        "stream_status",
        stream_status,
        "a stream's send and consume lists, groups (replicas, depth, state), lease holders, why consumption waits",
    )
    sub = command(
        "list_streams", list_streams, "list streams: lists, depth, producer and consumer, why consumption waits"
    )
    sub.add_argument("-p", "--vhost", default="", help="only this vhost")
    for verb in verbs:  # last: a verb's own options keep their names
        _global_options(verb, after_the_command=True)
    return out


def main(argv: list[str] | None = None) -> int:
    cli = parser()
    args = cli.parse_args(argv)
    if args.node is not None:
        args.nodes, where = _split_addresses(args.node), "argument --node"
        if not args.nodes:
            cli.error(f"{where}: expected HOST:PORT[,HOST:PORT...]")
    else:
        args.nodes, where = _split_addresses(os.environ.get(NODE_ENV, "") or DEFAULT_NODE), f"${NODE_ENV}"
    for address in args.nodes:
        problem = _address_problem(address)
        if problem is not None:
            cli.error(f"{where}: {problem}")
    keys = [key for key, _ in getattr(args, "arguments", [])]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        cli.error(f"argument --argument: {', '.join(map(repr, repeated))} given more than once")
    if (args.auth_user is None) != (args.auth_password is None):
        cli.error("--user and --password go together")
    if (args.tls_cert is None) != (args.tls_key is None):
        cli.error("--tls-cert and --tls-key go together")
    if args.tls_cert is not None and args.tls_ca is None:
        cli.error("--tls-cert needs --tls-ca")
    credentials = Credentials(args.auth_user, args.auth_password) if args.auth_user is not None else None
    tls = TLS(ca=args.tls_ca, certificate=args.tls_cert, key=args.tls_key) if args.tls_ca else None
    admin = Admin(args.nodes, args.timeout, tls, credentials)
    try:
        as_json, text = args.run(admin, args)
    except grpc.RpcError as error:
        print(f"ringqctl: {_error_text(error)}", file=sys.stderr)
        return 1
    except Failure as failure:
        print(f"ringqctl: {failure.code.name}: {_one_line(failure.message)}", file=sys.stderr)
        return 1
    print(json.dumps(as_json, indent=2, sort_keys=True) if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
