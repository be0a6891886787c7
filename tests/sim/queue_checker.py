"""The oracle of the queue simulation: what services/queue/replica_core.py promises, checked against
everything the simulated replicas and clients do.

Checked as it happens:
- one master per epoch, and a replica is master only of the epoch the record gave it;
- a confirm is released only when every replica the record lists as master or synchronised mirror
  holds the message on disk (durable part of its log);
- a message the consumer acknowledged is never delivered again unflagged (redelivered false); a
  publisher's resend of a message whose confirm it never got may come back as a new message (a
  duplicate, counted, as at-least-once allows) once the queue forgot its publisher sequence number;
- no replica finds itself inconsistent with its master unless its disk was faulted.
Checked once the liveness phase ends: every confirmed message was delivered; one master serves;
every live node is a synchronised mirror holding exactly the master's messages. One loss is allowed, as
the README says: when the recovery wait ran out before every listed replica was back and reachable, and
the disks of the others were damaged or cut, what only the missing replica held is given up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.coordinator.metadata import QueueRecord
from services.queue.master import Delivery
from services.queue.ops import Message
from services.queue.replica_core import CompleteStep, QueueEvent, Role

if TYPE_CHECKING:
    from tests.sim.queue_sim import QueueSimulation, SimReplica


class QueueChecker:
    def __init__(self, sim: QueueSimulation) -> None:
        self.sim = sim
        self.masters: dict[int, str] = {}  # epoch -> node
        self.published: set[int] = set()
        self.confirmed: set[int] = set()
        self.delivered: dict[int, int] = {}  # seq -> times
        self.acked: set[int] = set()  # message ids
        self.duplicates = 0  # deliveries of a publisher sequence number already delivered as another message
        self.delivered_ids: dict[int, int] = {}  # publisher seq -> the message id it was last delivered as
        self.faulted_disks: set[str] = set()
        self.events: list[QueueEvent] = []
        self.deliveries = 0
        self.recovered_without: list[str] = []  # listed replicas an election went ahead without

    # ---------------------------------------------------------------- events

    def on_record(self, record: QueueRecord) -> None:
        if record.master_epoch:
            holder = self.masters.setdefault(record.master_epoch, record.master)
            assert holder == record.master, f"epoch {record.master_epoch} given to {holder} and to {record.master}"

    def after_effects(self, replica: SimReplica) -> None:
        core = replica.core
        if core.role is Role.MASTER:
            holder = self.masters.get(core.epoch)
            assert holder == replica.node.name, (
                f"{replica.node.name} serves as master of epoch {core.epoch}, which the record gave to {holder}"
            )

    def on_published(self, seqs: list[int]) -> None:
        self.published.update(seqs)

    def on_confirmed(self, replica: SimReplica, seqs: list[int]) -> None:
        record = self.sim.record
        listed = [n for n in (record.master, *record.synchronised_mirrors) if n]
        master = replica.core.master
        assert master is not None
        ids = {m.id for m in master.core.contents.messages.values() if m.publisher_seq in seqs}
        for node in listed:
            held = self.sim.nodes[node].disk.durable_ids()
            missing = ids - held
            assert not missing, f"confirmed messages {sorted(missing)[:5]} are not on the disk of {node} (listed)"
        self.confirmed.update(seqs)

    def on_step_complete(self, replica: SimReplica, complete: CompleteStep) -> None:
        pass

    def on_delivered(self, delivery: Delivery) -> None:
        message = delivery.message
        seq = message.publisher_seq
        self.deliveries += 1
        if message.id in self.acked:
            assert delivery.redelivered, f"message {seq} (id {message.id}) was acknowledged and came back unflagged"
        if self.delivered_ids.get(seq, message.id) != message.id:
            self.duplicates += 1
        self.delivered_ids[seq] = message.id
        self.delivered[seq] = self.delivered.get(seq, 0) + 1

    def on_acked(self, message: Message) -> None:
        self.acked.add(message.id)

    def on_event(self, event: QueueEvent) -> None:
        self.events.append(event)
        if event.kind == "mirror_desynchronised":
            assert event.node in self.faulted_disks, f"{event.node} found itself inconsistent: {event.detail}"

    def on_crash(self, node: str) -> None:
        pass

    def on_disk_fault(self, node: str) -> None:
        self.faulted_disks.add(node)

    def on_recovery_without(self, nodes: list[str]) -> None:
        self.recovered_without += nodes

    def given_up(self) -> bool:
        """May confirmed messages have been given up (see the module docstring)?"""
        return bool(self.recovered_without) and bool(self.faulted_disks)

    def check_step(self) -> None:
        pass

    # ---------------------------------------------------------------- the end

    def converged(self) -> bool:
        """Has the liveness phase reached what `check_converged` demands?"""
        try:
            self.check_converged()
        except AssertionError:
            return False
        return True

    def check_converged(self) -> None:
        sim = self.sim
        lost = sorted(self.confirmed - set(self.delivered))
        assert not lost or self.given_up(), f"{len(lost)} confirmed messages never delivered: {lost[:10]}"
        unconfirmed = sorted(set(range(1, sim.config.messages + 1)) - self.confirmed)
        assert not unconfirmed, f"{len(unconfirmed)} messages never confirmed: {unconfirmed[:10]}"
        master = sim.master_replica()
        assert master is not None, f"no master serves at the end: {sim.record}"
        assert master.core.master is not None
        held = set(master.core.master.core.contents.messages)
        record = sim.record
        for node in sim.nodes.values():
            if node.name == record.master:
                continue
            assert node.name in record.synchronised_mirrors, (
                f"{node.name} is not a synchronised mirror at the end: {record}; "
                f"{node.replica.core.status() if node.replica else 'no replica'}"
            )
            replica = node.replica
            assert replica is not None and replica.core.mirror is not None
            mirrored = set(replica.core.mirror.contents.messages)
            assert mirrored == held, f"{node.name} holds {sorted(mirrored ^ held)[:5]} differently from the master"
