"""Durable mirrors: which confirms wait for the mirrors' disks, and who recovers a queue
whose master does not come back after a restart.

Responsible for the pure rules; services/queue/replica.py carries them out.

- Every replica of a durable queue keeps a message log (message_log.py): the
  master from its start, a mirror from the moment it is synchronised (it
  writes what it holds, then every persistent change the master reports).
  A log's *mark* is its `Position`: the epoch of the master whose reports it
  applied and the GM sequence number of the last one it made durable. Each new
  master's epoch is one more than the last it knew (a promoted mirror's, or a
  restarted master's own), so positions order the replicas' histories.
- A persistent change is confirmed only when the master's disk and the disk
  of every *required* mirror hold it: a mirror is required from the moment it
  says it is synchronised until the coordinator's record no longer lists it
  as synchronised (a dead mirror holds confirms back until the master has
  struck it from the record). The master marks a mirror synchronised in the
  record only once that mirror's disk holds every persistent change confirmed
  before. Together: **every replica the record lists as master or
  synchronised mirror has every confirmed persistent message on its disk**,
  whatever crashes when.
- After a restart, a replica whose queue's master is not in the group puts its
  position in the record (`recovery_positions`) and waits. If the master comes
  back, it takes the queue as before (its log holds everything it confirmed)
  and the others start over as empty mirrors. If it has not come back when
  the wait ends, `elect` names the replica that knows most among those the
  record lists as synchronised (any that came back if ha-promote-on-failure is
  always), and that replica recovers the queue from its log.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from ringq.v1 import queue_replication_pb2
from services.queue import wire
from services.queue.contents import QueueContents
from services.queue.message_log import MessageLog
from services.queue.ops import Discard, Enqueue, Message, Report, Settle

Token = TypeVar("Token", bound=Hashable)


@dataclass(frozen=True, order=True, slots=True)
class Position:
    """How far a replica's log goes: the master's epoch, then its report's sequence number."""

    epoch: int = 0
    seq: int = 0

    def encode(self) -> str:
        return f"{self.epoch}.{self.seq}"

    def mark(self) -> bytes:
        """As a message log's mark."""
        return self.encode().encode()

    @classmethod
    def decode(cls, text: str | bytes) -> Position:
        """The position `encode` wrote; the lowest position for anything else (an empty mark, garbage)."""
        value = text.decode(errors="replace") if isinstance(text, bytes) else text
        epoch, _, seq = value.partition(".")
        if not (epoch.isdigit() and seq.isdigit()):
            return cls()
        return cls(int(epoch), int(seq))


class PersistedWaits(Generic[Token]):
    """The master's account of its mirrors' disks: which of its reports each mirror
    made durable, and which waiting steps may now be confirmed."""

    def __init__(self) -> None:
        self.through: dict[str, int] = {}  # node -> the master's last report it made durable
        self._waiting: list[tuple[int, Token, Collection[str] | None]] = []

    def persisted(self, node: str, through_seq: int) -> None:
        self.through[node] = max(self.through.get(node, 0), through_seq)

    def forget(self, node: str) -> None:
        """`node`'s mirror is gone: a new one starts from nothing."""
        self.through.pop(node, None)

    def holds(self, seq: int, required: Collection[str]) -> bool:
        """Does every required mirror's disk hold the master's reports up to `seq`?"""
        return all(self.through.get(node, 0) >= seq for node in required)

    def wait(self, seq: int, token: Token, only: Collection[str] | None = None) -> None:
        """Wait for the reports up to `seq` on the required mirrors' disks (on `only`'s, if given)."""
        self._waiting.append((seq, token, only))

    def release(self, required: Collection[str]) -> list[Token]:
        """The waiting tokens whose reports their mirrors now hold (they are forgotten)."""
        ready = [token for seq, token, only in self._waiting if self.holds(seq, required if only is None else only)]
        if ready:
            done = set(ready)
            self._waiting = [entry for entry in self._waiting if entry[1] not in done]
        return ready

    def take_all(self) -> list[Token]:
        """Every waiting token (forgotten): the master is stopping, nothing will be confirmed."""
        tokens = [token for _, token, _ in self._waiting]
        self._waiting = []
        return tokens

    def drop(self, token: Token) -> None:
        self._waiting = [entry for entry in self._waiting if entry[1] != token]


def elect(
    recovery_positions: Mapping[str, str],
    synchronised_mirrors: Sequence[str],
    mirrors: Sequence[str],
    live_nodes: Collection[str],
    *,
    promote_unsynchronised: bool,
) -> str | None:
    """The node that recovers a queue whose master did not come back: the live replica
    with the furthest position among the synchronised ones (among all that came back
    with `promote_unsynchronised`), the eldest mirror on a tie; None if there is none."""
    positions = {node: Position.decode(text) for node, text in recovery_positions.items() if node in live_nodes}
    candidates = [node for node in positions if node in synchronised_mirrors]
    if not candidates and promote_unsynchronised:
        candidates = list(positions)
    if not candidates:
        return None
    seniority = {node: index for index, node in enumerate(mirrors)}
    return max(candidates, key=lambda node: (positions[node], -seniority.get(node, len(mirrors))))


def persist_reports(log: MessageLog, reports: Iterable[Report]) -> bool:
    """Append the persistent changes among `reports` to `log`; True if there were any
    (settling transient messages changes nothing on disk)."""
    appended = False
    for report in reports:
        if isinstance(report, Enqueue) and report.message.persistent:
            log.append_enqueue(report.message.id, wire.message_to_proto(report.message).SerializeToString())
            appended = True
        elif isinstance(report, Settle | Discard):
            appended = log.append_remove(report.ids) > 0 or appended
    return appended


def persistent_holdings(messages: Mapping[int, Message]) -> list[Message]:
    """What of a replica's messages belongs in its log: the persistent ones, in id order."""
    return [messages[message_id] for message_id in sorted(messages) if messages[message_id].persistent]


def append_enqueues(log: MessageLog, messages: Iterable[Message]) -> None:
    for message in messages:
        log.append_enqueue(message.id, wire.message_to_proto(message).SerializeToString())


def contents_from_log(log: MessageLog) -> QueueContents:
    """A replica's messages as its log kept them. They may have been delivered before the
    restart, so they come back counted as delivered once (redelivered on their next delivery)."""
    contents = QueueContents()
    for _, payload in log.recover():
        message = wire.message_from_proto(queue_replication_pb2.ReplicatedMessage.FromString(payload))
        message.delivery_count = max(message.delivery_count, 1)
        contents.apply(Enqueue(message))
    return contents
