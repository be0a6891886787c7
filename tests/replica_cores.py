"""A test driver for ReplicaCore (services/queue/replica_core.py): a fake coordinator that applies the
record changes the core asks for at once, and helpers that feed it what its shell would.

A core under test is a `Driven`: `.run(effects)` carries out record updates inline (the record's
version goes up as the coordinator's would) and keeps every other effect in `.effects` for the test to
look at.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar

from services.coordinator.metadata import QueueRecord
from services.queue.durability import Claim, Position
from services.queue.ops import Depth, Enqueue, Message, MirrorSays, Persisted, Report, Undecodable
from services.queue.replica_core import (
    Broadcast,
    CompleteStep,
    Effect,
    FlushLog,
    LogRecovery,
    ReplicaCore,
    ReplicaTimers,
    Role,
    UpdateRecord,
)

E = TypeVar("E")
HA = {"ha-mode": "all", "ha-sync-mode": "automatic"}
TIMERS = ReplicaTimers(depth_report_interval_ms=1000, look_for_master_ms=2000, recovery_wait_ms=5000)


def record(**changes: Any) -> QueueRecord:
    base = QueueRecord(
        "/",
        "q",
        durable=True,
        master="node1",
        mirrors=("node2",),
        policy="ha",
        policy_definition=HA,
        gm_group="queue.x",
        version=1,
    )
    return dataclasses.replace(base, **changes)


class Driven:
    """A core, its record as the coordinator holds it, and the effects it asked for."""

    def __init__(self, node: str, queue: QueueRecord, recovery: LogRecovery | None = None) -> None:
        self.record = queue
        self.core = ReplicaCore(node, queue, 0, TIMERS)
        self.effects: list[Effect] = []
        self.now = 0
        self.run(self.core.start(recovery if recovery is not None or not queue.durable else LogRecovery()))

    def run(self, effects: list[Effect]) -> list[Effect]:
        """Carry out record updates inline; keep (and return) the rest."""
        kept = self._carry_out(effects)
        self.effects += kept
        return kept

    def _carry_out(self, effects: list[Effect]) -> list[Effect]:
        kept: list[Effect] = []
        for effect in effects:
            if isinstance(effect, UpdateRecord):
                changed = effect.change(self.record)
                if changed is not None:
                    self.record = dataclasses.replace(changed, version=self.record.version + 1)
                kept += self._carry_out(self.core.on_record(self.record, self.now))
            else:
                kept.append(effect)
        return kept

    def set_record(self, **changes: Any) -> list[Effect]:
        self.record = dataclasses.replace(self.record, version=self.record.version + 1, **changes)
        return self.run(self.core.on_record(self.record, self.now))

    def take(self, kind: type[E]) -> list[E]:
        """The effects of `kind` asked for so far (they are forgotten)."""
        found: list[E] = [e for e in self.effects if isinstance(e, kind)]
        self.effects = [e for e in self.effects if not isinstance(e, kind)]
        return found

    def said(self) -> list[Report | MirrorSays]:
        return [report for b in self.take(Broadcast) for report in b.reports]

    def reports(self, publisher: str, first_seq: int, *reports: Report | MirrorSays | Undecodable) -> list[Effect]:
        return self.run(self.core.on_reports(publisher, first_seq, list(reports), self.now))

    def confirm_ring(self) -> list[Effect]:
        """The ring confirms everything broadcast so far."""
        return self.run(self.core.on_ring_confirmed(self.core.next_seq - 1, self.now))

    def flush_all(self) -> list[Effect]:
        """Every flush asked for completes."""
        done: list[Effect] = []
        for flush in self.take(FlushLog):
            done += self.run(self.core.on_log_flushed(flush.flush_id, self.now))
        return done

    def completed(self) -> list[CompleteStep]:
        return self.take(CompleteStep)

    def tick(self, to_ms: int) -> list[Effect]:
        self.now = to_ms
        return self.run(self.core.tick(to_ms))


def fresh_master(
    *,
    durable: bool = True,
    mirrors: Sequence[str] = ("node2",),
    synchronised: Sequence[str] = (),
    definition: dict[str, Any] | None = None,
    live: Sequence[str] = ("node2.b",),
) -> Driven:
    """node1 masters a new queue (epoch 1), its mirrors' members `live` in the group."""
    driven = Driven(
        "node1",
        record(durable=durable, mirrors=tuple(mirrors), policy_definition=definition or HA),
    )
    driven.run(driven.core.on_joined("node1.a", ["node1.a", *live], 0))
    if synchronised:
        driven.set_record(synchronised_mirrors=tuple(synchronised))
    assert driven.core.role is Role.MASTER, driven.core.status()
    driven.flush_all()
    driven.confirm_ring()
    driven.completed()
    driven.take(Broadcast)
    return driven


def mirror_of(
    master_member: str = "node1.a",
    *,
    durable: bool = True,
    epoch: int = 1,
    members: Sequence[str] = (),
    **changes: Any,
) -> Driven:
    """node2 mirrors a queue whose master (`master_member`, epoch `epoch`) serves and is heard; `members`,
    other mirrors' members, were in the group when node2 joined."""
    driven = Driven("node2", record(durable=durable, master_epoch=epoch, **changes))
    driven.run(driven.core.on_joined("node2.b", [master_member, "node2.b", *members], 0))
    driven.reports(master_member, 1, Depth(0, epoch))
    assert driven.core.role is Role.MIRROR, driven.core.status()
    return driven


def persistent(message_id: int, body: bytes = b"kept") -> Enqueue:
    return Enqueue(Message(message_id, body, persistent=True))


def persisted(mirror: str, master: str, through_seq: int) -> Persisted:
    return Persisted(mirror, master, through_seq)


def claim(epoch: int, seq: int, damaged: bool = False) -> Claim:
    return Claim(Position(epoch, seq), damaged)
