"""Durable queues: how far a replica's log goes, and which replica recovers a queue that no master
serves after a restart (pure rules; services/queue/replica_core.py applies them).

- Every replica of a durable queue keeps a message log (message_log.py): the master from its
  start, a mirror from the moment it is synchronised. A log's *mark* is a `Position`: the epoch of
  the master whose reports the log reflects and the GM sequence number of the last of them that
  changed the log, so equal logs carry equal marks. (A mirror synchronised by a sync saw none of the
  changes it holds: it takes the master's mark, which the master's depth reports carry.) Each new
  master's epoch is one more than the record's (`QueueRecord.master_epoch`, raised by
  compare-and-set), so positions order replicas' histories: within one epoch every log is a prefix
  of the same report stream.
- After a restart a replica that hears no serving master *claims*: it puts the position of its
  log's intact prefix in the record (`recovery_positions`), flagged when the log is damaged (a bad
  record followed by good ones: see message_log.py). `elect` names the replica that recovers the
  queue: the live claimant, among those the record lists as master or synchronised mirror (any
  claimant under ha-promote-on-failure always), whose intact log goes furthest; on a tie an
  undamaged log, then the record's master, then the eldest mirror. `election_due` says when to
  decide: once every listed replica has claimed and is live, or when the wait ends (a listed replica
  that never comes back cannot hold the queue up for ever, but one that comes back in time is waited
  for, so a damaged or cut log does not win for want of the healthy one).
- A loser keeps its log and catches up from the winner when its log is a prefix of the winner's
  (same epoch, not damaged): `keeps_log`. Otherwise its log may hold a tail nobody confirmed (an old
  master's unreplicated decisions), and it starts over empty.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from services.queue.ops import Discard, Enqueue, Message, Report, Settle, unpacked

DAMAGED = "damaged"


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


@dataclass(frozen=True, slots=True)
class Claim:
    """What a restarted replica says of its log in the record: the position of its intact prefix,
    and whether damage was found after it."""

    position: Position = field(default_factory=Position)
    damaged: bool = False

    def encode(self) -> str:
        return f"{self.position.encode()} {DAMAGED}" if self.damaged else self.position.encode()

    @classmethod
    def decode(cls, text: str) -> Claim:
        position, _, flag = text.partition(" ")
        return cls(Position.decode(position), flag == DAMAGED)


def listed_replicas(master: str, synchronised_mirrors: Sequence[str]) -> tuple[str, ...]:
    """The replicas a record says hold every confirmed message: the master and the synchronised mirrors."""
    return tuple(dict.fromkeys(node for node in (master, *synchronised_mirrors) if node))


def election_due(
    claims: Mapping[str, Claim],
    master: str,
    synchronised_mirrors: Sequence[str],
    live_nodes: Collection[str],
    *,
    waited_enough: bool,
) -> bool:
    """Decide now? Once every listed replica has claimed and is live (a claim left by a replica that has
    gone again since does not count: elect would pass it over), or once the wait is over."""
    listed = listed_replicas(master, synchronised_mirrors)
    return waited_enough or all(node in claims and node in live_nodes for node in listed)


def elect(
    claims: Mapping[str, Claim],
    master: str,
    synchronised_mirrors: Sequence[str],
    mirrors: Sequence[str],
    live_nodes: Collection[str],
    *,
    promote_unsynchronised: bool,
) -> str | None:
    """The node that recovers the queue (see the module docstring); None if no claimant may."""
    listed = listed_replicas(master, synchronised_mirrors)
    live_claims = {node: claim for node, claim in claims.items() if node in live_nodes}
    candidates = [node for node in live_claims if node in listed]
    if not candidates and promote_unsynchronised:
        candidates = list(live_claims)
    if not candidates:
        return None
    seniority = {node: index for index, node in enumerate(mirrors)}

    def rank(node: str) -> tuple[Position, bool, bool, int]:
        claim = live_claims[node]
        return claim.position, not claim.damaged, node == master, -seniority.get(node, len(mirrors))

    return max(candidates, key=rank)


def keeps_log(own: Claim, winner: Claim) -> bool:
    """May a losing replica keep its log and catch up from the winner (its log a prefix of the winner's)?"""
    return not own.damaged and own.position.epoch == winner.position.epoch and own.position <= winner.position


def log_changes(reports: Iterable[Report]) -> tuple[list[Message], list[int]]:
    """What of `reports` a log must record: the persistent messages enqueued, and the ids removed
    (the log ignores ids it does not hold, such as transient messages')."""
    enqueued: list[Message] = []
    removed: list[int] = []
    for report in reports:
        for change in unpacked(report):
            if isinstance(change, Enqueue):
                if change.message.persistent:
                    enqueued.append(change.message)
            elif isinstance(change, Settle | Discard):
                removed.extend(change.ids)
    return enqueued, removed


def persistent_holdings(messages: Mapping[int, Message]) -> list[Message]:
    """What of a replica's messages belongs in its log: the persistent ones, in id order."""
    return [messages[message_id] for message_id in sorted(messages) if messages[message_id].persistent]
