"""Deterministic simulation of a mirrored, durable queue: ring cores and replica cores driven together
over simulated nodes, disks, a coordinator and clients, under seeded faults.

Responsible for: playing every shell's part. Nodes host one replica of the queue (a `ReplicaCore`
and its ring member) and recreate it when the record places them and they have none; disks are
`SimDisk`s; the coordinator holds the group table and the queue record (compare-and-set), watches
them to every node it reaches and re-places mirrors on live nodes (ha-mode all); a producer
publishes persistent messages to the master, resending what was not confirmed; a consumer consumes
with a prefetch and acknowledges. Everything that happens goes to the `QueueChecker`.

A run has a safety phase with faults (crashes of a node or of the master, whole-cluster crashes
restarted in any order with damaged and cut logs, full disks, a node cut off from the coordinator,
a link cut between two nodes), then a liveness phase with no new faults and everything healed,
which must converge: one master, every live node a synchronised mirror, every confirmed message
delivered. The same seed replays the same run.
"""

from __future__ import annotations

import functools
import random
from collections import deque
from dataclasses import dataclass, field, replace

from services.coordinator.metadata import QueueRecord
from services.gm.messages import Confirmed, Deliver, Joined, MembersChanged, Stopped
from services.queue import wire
from services.queue.master import Delivery, Publish, PublishOutcome, QueueError, Settlement
from services.queue.ops import Message
from services.queue.replica_core import (
    AbandonSteps,
    AppendToLog,
    Broadcast,
    CompleteStep,
    DeleteRecord,
    DiscardLog,
    Effect,
    EndConsumers,
    FlushLog,
    Noted,
    ReleaseConfirms,
    ReplicaCore,
    ReplicaTimers,
    Role,
    Stop,
    UpdateRecord,
    WatchDisk,
    WriteLog,
    describe,
)
from tests.sim.queue_checker import QueueChecker
from tests.sim.scheduler import Scheduler
from tests.sim.sim_disk import Op, SimDisk, _copy
from tests.sim.sim_ring import GroupStore, SimMember

QUEUE = "q"
PUBLISHER = "producer"
TIMERS = ReplicaTimers(depth_report_interval_ms=500, look_for_master_ms=1500, recovery_wait_ms=4000)


@dataclass
class QueueSimConfig:
    """The fault model; each seed draws its schedule within these bounds."""

    nodes: tuple[int, int] = (2, 4)
    fault_phase_ms: int = 30_000
    liveness_ms: int = 90_000
    messages: int = 120
    faults: tuple[int, int] = (2, 6)
    max_events: int = 3_000_000


@dataclass
class SimNode:
    name: str
    disk: SimDisk = field(default_factory=SimDisk)
    up: bool = True
    reaches_coordinator: bool = True
    replica: SimReplica | None = None
    incarnation: int = 0
    restart_after_ms: int = 0


class QueueSimulation:
    """One seeded run; `run()` raises AssertionError (naming the seed) on a violation."""

    def __init__(self, seed: int, config: QueueSimConfig | None = None) -> None:
        self.seed = seed
        self.config = config or QueueSimConfig()
        self.rng = random.Random(seed)
        self.scheduler = Scheduler(self.config.max_events)
        count = self.rng.randint(*self.config.nodes)
        self.nodes = {f"n{i}": SimNode(f"n{i}") for i in range(1, count + 1)}
        self.groups = GroupStore("queue.sim", self)
        definition = {"ha-mode": "all", "ha-sync-mode": "automatic"}
        if self.rng.random() < 0.3:
            definition["ha-min-synchronised"] = 0  # type: ignore[assignment]
        self.record = QueueRecord(
            "/",
            QUEUE,
            durable=True,
            master="n1",
            mirrors=tuple(sorted(self.nodes))[1:],
            policy="ha",
            policy_definition=definition,
            gm_group="queue.sim",
            version=1,
        )
        self.cuts: set[frozenset[str]] = set()
        self.members: dict[str, SimMember] = {}
        self.checker = QueueChecker(self)
        self.producer = Producer(self)
        self.consumer = Consumer(self)
        self.faults = True
        self.trace = False  # print every effect (replaying a seed: tests.sim.run_queues --seed S --trace)

    # ------------------------------------------------------------------ the world (sim_ring.Network)

    def node_up(self, node: str) -> bool:
        return node in self.nodes and self.nodes[node].up

    def linked(self, a: str, b: str) -> bool:
        return self.node_up(a) and self.node_up(b) and frozenset((a, b)) not in self.cuts

    def reaches_coordinator(self, node: str) -> bool:
        return self.node_up(node) and self.nodes[node].reaches_coordinator

    def member(self, member_id: str) -> SimMember | None:
        return self.members.get(member_id)

    def members_of_group(self) -> list[SimMember]:
        return [m for m in self.members.values() if not m.gone]

    # ------------------------------------------------------------------ driver

    def run(self) -> QueueSimulation:
        try:
            for node in self.nodes.values():
                self.scheduler.at(self.rng.randint(0, 300), functools.partial(self._ensure_replica, node))
            self.producer.start()
            self.consumer.start()
            self.scheduler.at(1000, self._place)
            self._plan_faults()
            self.scheduler.run_until(self.config.fault_phase_ms, self.checker.check_step)
            self._heal()
            deadline = self.config.fault_phase_ms + self.config.liveness_ms
            while self.scheduler.now_ms < deadline and not self.checker.converged():
                self.scheduler.run_until(min(deadline, self.scheduler.now_ms + 2000), self.checker.check_step)
            self.checker.check_converged()
        except AssertionError as error:
            raise AssertionError(f"seed {self.seed} at t={self.scheduler.now_ms}ms: {error}") from error
        except Exception as error:
            raise AssertionError(f"seed {self.seed} at t={self.scheduler.now_ms}ms: {error!r}") from error
        return self

    def now(self) -> int:
        return self.scheduler.now_ms

    def master_replica(self) -> SimReplica | None:
        """The replica serving as master where the record says, if it runs."""
        node = self.nodes.get(self.record.master)
        if node is None or not node.up or node.replica is None or node.replica.gone:
            return None
        return node.replica if node.replica.core.role is Role.MASTER else None

    # ------------------------------------------------------------------ the coordinator

    def update_record(self, node: str, update: UpdateRecord, deliver: SimReplica) -> None:
        """A compare-and-set from `node`, retried until its node reaches the coordinator."""

        def attempt() -> None:
            if not self.node_up(node) or deliver.gone:
                return
            if not self.reaches_coordinator(node):
                self.scheduler.at(100, attempt)
                return
            changed = update.change(self.record)
            if changed is not None and changed != self.record:
                self._write_record(changed)
            record = self.record
            self.scheduler.at(self.rng.randint(1, 5), lambda: deliver.on_record(record))

        self.scheduler.at(self.rng.randint(1, 8), attempt)

    def _write_record(self, record: QueueRecord) -> None:
        previous = self.record
        self.record = replace(record, version=self.record.version + 1)
        if (
            previous.recovery_positions
            and not record.recovery_positions
            and record.master_epoch > previous.master_epoch
        ):
            listed = [n for n in (previous.master, *previous.synchronised_mirrors) if n]
            in_group = {entry.node for entry in self.groups.group.members if entry.alive}
            missing = [n for n in listed if n not in previous.recovery_positions or n not in in_group]
            if missing:
                self.checker.on_recovery_without(missing)
        if self.trace:
            r = self.record
            print(
                f"{self.now():>7} RECORD v{r.version} master={r.master} epoch={r.master_epoch} mirrors={r.mirrors} "
                f"synchronised={r.synchronised_mirrors} claims={dict(r.recovery_positions)}"
            )
        self.checker.on_record(self.record)
        written = self.record
        for node in self.nodes.values():
            if node.up and node.reaches_coordinator:
                self.scheduler.at(self.rng.randint(1, 20), functools.partial(self._watch, node, written))

    def _watch(self, node: SimNode, record: QueueRecord) -> None:
        if not node.up or not node.reaches_coordinator:
            return
        if node.replica is not None and not node.replica.gone:
            node.replica.on_record(record)
        else:
            self._ensure_replica(node)

    def _place(self) -> None:
        """Policies applied live: every live node that is not the master mirrors the queue."""
        live = sorted(n.name for n in self.nodes.values() if n.up and n.reaches_coordinator)
        record = self.record
        # As the coordinator's placement: a synchronised mirror is struck only by the queue's master.
        live += [m for m in record.synchronised_mirrors if m in record.mirrors and m not in live]
        if record.master in live:
            mirrors = tuple(m for m in record.mirrors if m in live) + tuple(
                n for n in live if n != record.master and n not in record.mirrors
            )
            synchronised = tuple(m for m in record.synchronised_mirrors if m in mirrors)
            if mirrors != record.mirrors or synchronised != record.synchronised_mirrors:
                self._write_record(replace(record, mirrors=mirrors, synchronised_mirrors=synchronised))
        self.scheduler.at(1000, self._place)

    # ------------------------------------------------------------------ nodes

    def _ensure_replica(self, node: SimNode) -> None:
        """The node's queue manager: a replica for the record if it places this node and none runs."""
        if not node.up or not node.reaches_coordinator:
            return
        record = self.record
        placed = node.name == record.master or node.name in record.mirrors
        if node.replica is not None and not node.replica.gone:
            return
        if not placed:
            return
        node.incarnation += 1
        member_id = f"{node.name}.{node.incarnation}"
        replica = SimReplica(self, node, record, member_id)
        node.replica = replica
        replica.start()

    def replica_stopped(self, node: SimNode) -> None:
        """The manager recreates a stopped replica while the record still places its node."""
        self.scheduler.at(self.rng.randint(200, 1500), lambda: self._ensure_replica(node))

    def crash(self, node: SimNode) -> None:
        if not node.up:
            return
        node.up = False
        node.disk.crash()
        if node.replica is not None:
            node.replica.crash()
            node.replica = None
        self.checker.on_crash(node.name)

    def restart(self, node: SimNode) -> None:
        if node.up:
            return
        node.up = True
        self.scheduler.at(self.rng.randint(0, 100), lambda: self._ensure_replica(node))

    # ------------------------------------------------------------------ faults

    def _plan_faults(self) -> None:
        rng, config = self.rng, self.config
        for _ in range(rng.randint(*config.faults)):
            at = rng.randint(2000, config.fault_phase_ms - 3000)
            kind = rng.choice(["crash", "crash_master", "crash_all", "disk_full", "coordinator_cut", "link_cut"])
            self.scheduler.at(at, functools.partial(self._fault, kind))

    def _fault(self, kind: str) -> None:
        if not self.faults:
            return
        if self.trace:
            print(f"{self.now():>7} FAULT {kind}")
        rng = self.rng
        up = [n for n in self.nodes.values() if n.up]
        duration = rng.randint(500, 5000)
        if kind in ("crash", "crash_master") and len(up) >= 2:
            victim = self.nodes.get(self.record.master) if kind == "crash_master" else rng.choice(up)
            if victim is not None and victim.up:
                self.crash(victim)
                self.scheduler.at(duration, functools.partial(self.restart, victim))
        elif kind == "crash_all":
            self._crash_all()
        elif kind == "disk_full" and up:
            disk = rng.choice(up).disk
            disk.full = True
            self.checker.on_disk_fault(next(n.name for n in up if n.disk is disk))
            self.scheduler.at(duration, functools.partial(setattr, disk, "full", False))
        elif kind == "coordinator_cut" and up:
            cut_off = rng.choice(up)
            cut_off.reaches_coordinator = False
            self.scheduler.at(duration, functools.partial(self._reconnect, cut_off))
        elif kind == "link_cut" and len(self.nodes) >= 3:
            a, b = rng.sample(sorted(self.nodes), 2)
            cut = frozenset((a, b))
            self.cuts.add(cut)
            self.scheduler.at(duration, lambda: self._heal_cut(cut))

    def _heal_cut(self, cut: frozenset[str]) -> None:
        """The link is back: as the link layer's on_reconnect, each member whose right neighbour is
        across it re-sends its Catchup (frames were lost meanwhile)."""
        self.cuts.discard(cut)
        for member in self.members_of_group():
            if member.node in cut:
                member.post(lambda core: core.resend_catchup())

    def _reconnect(self, node: SimNode) -> None:
        """Back in touch with the coordinator: its watches resync (members re-read their group)."""
        node.reaches_coordinator = True
        for member in self.members_of_group():
            if member.node == node.name:
                member.post(lambda core: core.check_membership())
        self._watch(node, self.record)

    def _crash_all(self) -> None:
        """Every node crashes; the logs of fewer than all listed replicas are damaged or cut (counting those
        spoiled by an earlier crash and not written whole since); all restart."""
        listed = [n for n in (self.record.master, *self.record.synchronised_mirrors) if n]
        for node in self.nodes.values():
            self.crash(node)
        intact = [n for n in listed if not self.nodes[n].disk.spoiled]
        spoiled = self.rng.sample(intact, self.rng.randint(0, max(0, len(intact) - 1)))  # one stays intact
        for name in spoiled:
            disk = self.nodes[name].disk
            if self.rng.random() < 0.5 and disk.groups:
                group = self.rng.randrange(len(disk.groups))
                if disk.groups[group]:
                    disk.damage(group, self.rng.randrange(len(disk.groups[group])))
            else:
                disk.cut_tail()
            self.checker.on_disk_fault(name)
        order = list(self.nodes.values())
        self.rng.shuffle(order)
        delay = self.rng.randint(200, 2000)
        for node in order:
            self.scheduler.at(delay, functools.partial(self.restart, node))
            delay += self.rng.randint(0, 3000)

    def _heal(self) -> None:
        self.faults = False
        for cut in list(self.cuts):
            self._heal_cut(cut)
        for node in self.nodes.values():
            node.disk.full = False
            if not node.up:
                self.restart(node)
            if not node.reaches_coordinator:
                self._reconnect(node)
        self.producer.finish()


class SimReplica:
    """A node's replica shell: a ReplicaCore, its ring member, its disk."""

    def __init__(self, sim: QueueSimulation, node: SimNode, record: QueueRecord, member_id: str) -> None:
        self.sim = sim
        self.node = node
        self.member_id = member_id
        self.core = ReplicaCore(node.name, record, sim.now(), TIMERS)
        self.member: SimMember | None = None
        self.gone = False
        self.flushes: list[int] = []
        self.to_do: deque[Effect] = deque()
        self.executing = False
        self.wakeup = None

    def start(self) -> None:
        recovery = self.node.disk.recover()
        self.execute(self.core.start(recovery))
        member = SimMember(self.sim, self.sim.groups, self.node.name, self.member_id, self)
        self.member = member
        self.sim.members[member.id] = member
        member.start()
        self._arm()

    def crash(self) -> None:
        self.gone = True
        if self.member is not None:
            self.member.crash()
        self.sim.consumer.replica_gone(self)

    # ---------------------------------------------------------------- inputs from the ring and the world

    def on_ring_event(self, event: Deliver | Confirmed | Joined | MembersChanged | Stopped) -> None:
        if self.gone:
            return
        now, core = self.sim.now(), self.core
        if self.sim.trace and not isinstance(event, (Deliver, Confirmed)):
            print(f"{now:>7} {self.member_id} RING {event}")
        if isinstance(event, Joined):
            self.execute(core.on_joined(self.member_id, event.members, now))
        elif isinstance(event, MembersChanged):
            self.execute(core.on_members_changed(event.births, event.deaths, now))
        elif isinstance(event, Deliver):
            reports = [wire.decode(body) for body in event.bodies]
            self.execute(core.on_reports(event.publisher, event.first_seq, reports, now))
        elif isinstance(event, Confirmed):
            self.execute(core.on_ring_confirmed(event.through_seq, now))
        else:
            self.execute(core.on_member_stopped(event.reason, now))

    def on_record(self, record: QueueRecord) -> None:
        if not self.gone:
            self.execute(self.core.on_record(record, self.sim.now()))

    def _arm(self) -> None:
        if self.gone:
            return
        wakeup = self.core.next_wakeup_ms()
        now = self.sim.now()
        delay = 200 if wakeup is None else max(1, min(200, wakeup - now))
        self.sim.scheduler.at(delay, self._tick)

    def _tick(self) -> None:
        if self.gone:
            return
        self.execute(self.core.tick(self.sim.now()))
        self._arm()

    # ---------------------------------------------------------------- effects

    def execute(self, effects: list[Effect]) -> None:
        """Carry out effects in the order the core emitted them. Carrying one out may feed the core again
        (a broadcast lets the member take its next input, whose deliveries reach the core): what that
        returns queues behind what is still to do, never ahead of it."""
        if self.sim.trace:
            for effect in effects:
                print(f"{self.sim.now():>7} {self.member_id:<6} {self.core.role.value:<10} {describe(effect)}")
        self.to_do.extend(effects)
        if self.executing:
            return
        self.executing = True
        try:
            while self.to_do and not self.gone:
                self._carry_out(self.to_do.popleft())
        finally:
            self.executing = False
        self.sim.checker.after_effects(self)

    def _carry_out(self, effect: Effect) -> None:
        sim, disk = self.sim, self.node.disk
        if isinstance(effect, Broadcast):
            assert self.member is not None
            self.member.broadcast([wire.encode(r) for r in effect.reports], effect.first_seq)
        elif isinstance(effect, AppendToLog):
            ops = [Op(enqueued=_copy(m)) for m in effect.enqueued]
            if effect.removed:
                ops.append(Op(removed=effect.removed))
            if effect.position is not None:
                ops.append(Op(mark=effect.position))
            disk.append(ops)
        elif isinstance(effect, WriteLog):
            disk.write_exactly(tuple(_copy(m) for m in effect.messages), effect.position, effect.fresh)
        elif isinstance(effect, FlushLog):
            self.flushes.append(effect.flush_id)
            if len(self.flushes) == 1:
                sim.scheduler.at(sim.rng.randint(1, 10), self._flush_done)
        elif isinstance(effect, DiscardLog):
            disk.discard()
        elif isinstance(effect, WatchDisk):
            sim.scheduler.at(300, lambda: self._retry_disk(300))
        elif isinstance(effect, UpdateRecord):
            sim.update_record(self.node.name, effect, self)
        elif isinstance(effect, DeleteRecord):
            raise AssertionError(f"a replica of the durable queue deleted it: {effect.purpose}")
        elif isinstance(effect, CompleteStep):
            sim.checker.on_step_complete(self, effect)
            sim.producer.step_complete(self, effect.step_id, effect.confirmed)
            sim.consumer.deliveries(self, tuple(effect.step.deliveries))
        elif isinstance(effect, ReleaseConfirms):
            for step_id in effect.step_ids:
                sim.producer.step_complete(self, step_id, True)
        elif isinstance(effect, AbandonSteps):
            sim.producer.steps_abandoned(self, effect.step_ids)
        elif isinstance(effect, EndConsumers):
            sim.consumer.replica_gone(self)
        elif isinstance(effect, Noted):
            sim.checker.on_event(effect.event)
        elif isinstance(effect, Stop):
            self.gone = True
            self.node.disk.close()
            if self.member is not None and not self.member.gone:
                self.member.post(lambda core: core.leave())
            sim.consumer.replica_gone(self)
            sim.replica_stopped(self.node)

    def _flush_done(self) -> None:
        if self.gone or not self.flushes:
            return
        flush_id = self.flushes.pop(0)
        if self.node.disk.flush():
            self.execute(self.core.on_log_flushed(flush_id, self.sim.now()))
        else:
            self.execute(self.core.on_disk_failed("no space left on device", self.sim.now()))
        if self.flushes:
            self.sim.scheduler.at(self.sim.rng.randint(1, 10), self._flush_done)

    def _retry_disk(self, backoff_ms: int) -> None:
        if self.gone:
            return
        if self.node.disk.reopen_fresh():
            self.execute(self.core.on_disk_writable(self.sim.now()))
        else:
            self.sim.scheduler.at(min(backoff_ms * 2, 4000), lambda: self._retry_disk(min(backoff_ms * 2, 4000)))


# ---------------------------------------------------------------------- clients


class Producer:
    """Publishes persistent messages 1..N to whoever is master; resends what was not confirmed."""

    def __init__(self, sim: QueueSimulation) -> None:
        self.sim = sim
        self.next_seq = 1
        self.unconfirmed: dict[int, int] = {}  # seq -> when it was last sent
        self.in_step: dict[tuple[int, int], list[int]] = {}  # (id of replica shell, step) -> seqs
        self.finishing = False

    def start(self) -> None:
        self.sim.scheduler.at(500, self._publish)

    def finish(self) -> None:
        self.finishing = True

    def _publish(self) -> None:
        sim = self.sim
        if self.next_seq <= sim.config.messages and not self.finishing:
            count = sim.rng.randint(1, 5)
            for _ in range(count):
                if self.next_seq <= sim.config.messages:
                    self.unconfirmed[self.next_seq] = -1
                    self.next_seq += 1
        due = [seq for seq, sent in self.unconfirmed.items() if sent < 0 or sim.now() - sent > 3000]
        if due:
            self._send(sorted(due)[:20])
        if self.unconfirmed or self.next_seq <= sim.config.messages:
            sim.scheduler.at(sim.rng.randint(20, 200), self._publish)

    def _send(self, seqs: list[int]) -> None:
        master = self.sim.master_replica()
        if master is None:
            return
        items = [Publish(body_of(seq), PUBLISHER, seq, persistent=True) for seq in seqs]
        try:
            step_id, outcomes, effects = master.core.publish(items, self.sim.now())
        except QueueError:
            return
        for seq in seqs:
            self.unconfirmed[seq] = self.sim.now()
        self.in_step[(id(master), step_id)] = [
            seq for seq, outcome in zip(seqs, outcomes, strict=True) if outcome is not PublishOutcome.REJECTED
        ]
        self.sim.checker.on_published(seqs)
        master.execute(effects)

    def step_complete(self, replica: SimReplica, step_id: int, confirmed: bool) -> None:
        seqs = self.in_step.get((id(replica), step_id))
        if seqs is None or not confirmed:
            return
        del self.in_step[(id(replica), step_id)]
        for seq in seqs:
            self.unconfirmed.pop(seq, None)
        self.sim.checker.on_confirmed(replica, seqs)

    def steps_abandoned(self, replica: SimReplica, step_ids: tuple[int, ...]) -> None:
        for step_id in step_ids:
            self.in_step.pop((id(replica), step_id), None)


class Consumer:
    """Consumes from the master with a prefetch and acknowledges each delivery after a while."""

    def __init__(self, sim: QueueSimulation) -> None:
        self.sim = sim
        self.attached: SimReplica | None = None
        self.tag = ""
        self.attachments = 0
        self.prefetch = sim.rng.choice([1, 3, 10, 50])

    def start(self) -> None:
        self.sim.scheduler.at(700, self._attach)

    def _attach(self) -> None:
        sim = self.sim
        if self.attached is None or self.attached.gone:
            master = sim.master_replica()
            if master is not None:
                self.attachments += 1
                tag = f"c{self.attachments}"
                try:
                    effects = master.core.consume(tag, self.prefetch, 0, sim.now())
                except QueueError:
                    effects = None
                if effects is not None:
                    self.attached, self.tag = master, tag
                    master.execute(effects)
        sim.scheduler.at(300, self._attach)

    def replica_gone(self, replica: SimReplica) -> None:
        if self.attached is replica:
            self.attached = None

    def deliveries(self, replica: SimReplica, deliveries: tuple[Delivery, ...]) -> None:
        for delivery in deliveries:
            if replica is not self.attached or delivery.consumer != self.tag:
                continue
            self.sim.checker.on_delivered(delivery)
            tag = self.tag
            self.sim.scheduler.at(self.sim.rng.randint(1, 60), functools.partial(self._ack, replica, tag, delivery))

    def _ack(self, replica: SimReplica, tag: str, delivery: Delivery) -> None:
        if replica.gone or replica is not self.attached or tag != self.tag or not replica.core.is_master:
            return
        try:
            ack = Settlement(delivery.delivery_tag, False, "ack")
            _, error, effects = replica.core.settle(tag, [ack], self.sim.now())
        except QueueError:
            return
        if error is None:
            self.sim.checker.on_acked(delivery.message)
        replica.execute(effects)


def body_of(seq: int) -> bytes:
    return f"m{seq}".encode()


def seq_of(message: Message) -> int:
    return message.publisher_seq
