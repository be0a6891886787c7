"""The pure rules of durable mirrors (services/queue/durability.py) and the master's wait for its
mirrors' disks (services/queue/replica.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from services.coordinator.metadata import QueueRecord
from services.gm.messages import Deliver as GmDeliver
from services.gm.messages import Stopped
from services.queue import wire
from services.queue.durability import PersistedWaits, Position, elect, persist_reports
from services.queue.master import Publish
from services.queue.message_log import MemoryMessageLog
from services.queue.ops import Depth, Desynchronised, Enqueue, Message, Persisted, Settle, Synchronised, SyncRequest
from services.queue.replica import QueueReplica
from services.queue.replica_disks import HOLDINGS_CHUNK
from tests.test_queue_replica_order import FakeHost, FakeLog, FakeMember


def test_positions_order_by_epoch_then_sequence_and_survive_their_encoding() -> None:
    assert Position(2, 1) > Position(1, 9_999)
    assert Position(1, 10) > Position(1, 9)
    assert Position.decode(Position(3, 42).encode()) == Position(3, 42)
    assert Position.decode(b"3.42") == Position(3, 42)
    for garbage in ("", "x", "1.", ".2", "-1.2", b"\xff"):
        assert Position.decode(garbage) == Position()


def test_persisted_waits_release_when_every_required_disk_holds_the_report() -> None:
    waits: PersistedWaits[str] = PersistedWaits()
    waits.wait(5, "step a")
    waits.wait(9, "step b")
    assert waits.release({"node2", "node3"}) == []
    waits.persisted("node2", 9)
    assert waits.release({"node2", "node3"}) == []
    waits.persisted("node3", 6)
    assert waits.release({"node2", "node3"}) == ["step a"]
    assert waits.release({"node2"}) == ["step b"]  # node3 was struck from the synchronised mirrors
    waits.persisted("node3", 3)  # an older report never moves a mirror back
    assert waits.through["node3"] == 6
    waits.forget("node3")
    assert not waits.holds(1, {"node3"})
    assert waits.holds(1, set())


def test_a_wait_can_name_its_own_mirrors() -> None:
    waits: PersistedWaits[str] = PersistedWaits()
    waits.wait(4, "mark node3", only=("node3",))
    waits.persisted("node3", 4)
    assert waits.release({"node2"}) == ["mark node3"]  # node2's disk is not asked


RECORD = {"synchronised_mirrors": ("node2", "node3"), "mirrors": ("node2", "node3")}


@pytest.mark.parametrize(
    ("positions", "live", "always", "winner"),
    [
        ({"node2": "1.10", "node3": "1.12"}, {"node2", "node3"}, False, "node3"),  # knows most
        ({"node2": "2.1", "node3": "1.900"}, {"node2", "node3"}, False, "node2"),  # a later master's term
        ({"node2": "1.10", "node3": "1.10"}, {"node2", "node3"}, False, "node2"),  # a tie: the eldest mirror
        ({"node2": "1.10", "node3": "1.12"}, {"node2"}, False, "node2"),  # node3 is not back
        ({"node4": "1.50"}, {"node4"}, False, None),  # not synchronised: refused under when-synced ...
        ({"node4": "1.50"}, {"node4"}, True, "node4"),  # ... taken under always
        ({}, {"node2", "node3"}, True, None),  # nobody came back with a log
    ],
)
def test_the_replica_that_knows_most_recovers(
    positions: dict[str, str], live: set[str], always: bool, winner: str | None
) -> None:
    assert (
        elect(positions, RECORD["synchronised_mirrors"], RECORD["mirrors"], live, promote_unsynchronised=always)
        == winner
    )


class SequencedMember(FakeMember):
    """Confirms each broadcast at once and numbers the reports as the ring would."""

    def __init__(self) -> None:
        super().__init__()
        self.next_seq = 1

    def broadcast_now(self, bodies: list[bytes], confirmed: bool) -> asyncio.Future[tuple[int, int]]:
        self.queued.append(bodies)
        first, self.next_seq = self.next_seq, self.next_seq + len(bodies)
        done: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
        done.set_result((first, first + len(bodies) - 1))
        return done


class InstantCommitter:
    async def commit(self) -> None:
        await asyncio.sleep(0)


class CoordinatorHost(FakeHost):
    """Applies record changes as the coordinator would."""

    async def update_record(
        self, record: QueueRecord, change: Callable[[QueueRecord], QueueRecord | None]
    ) -> QueueRecord:
        changed = change(record)
        return record if changed is None else dataclasses.replace(changed, version=record.version + 1)


def _durable_master(synchronised: tuple[str, ...]) -> QueueReplica:
    record = QueueRecord("/", "q", master="node1", mirrors=("node2",), synchronised_mirrors=synchronised)
    replica = QueueReplica(CoordinatorHost(), record)
    replica.member = SequencedMember()  # type: ignore[assignment]
    replica.log = FakeLog()  # type: ignore[assignment]
    replica.committer = InstantCommitter()  # type: ignore[assignment]
    return replica


def test_a_persistent_message_is_confirmed_once_the_synchronised_mirrors_disks_hold_it() -> None:
    async def scenario() -> None:
        replica = _durable_master(synchronised=("node2",))
        confirmed = replica.publish_in_order([Publish(b"keep me", persistent=True)])
        await asyncio.sleep(0.05)
        assert not confirmed.done(), "confirmed before the mirror's disk held it"
        master_member = FakeMember.id
        replica._on_report("node2.bbbb", wire.encode(Persisted("node2.bbbb", "node1.old", 1)), 1)
        await asyncio.sleep(0.01)
        assert not confirmed.done(), "a report of another master's sequence numbers counted"
        replica._on_report("node2.bbbb", wire.encode(Persisted("node2.bbbb", master_member, 1)), 2)
        await asyncio.wait_for(confirmed, 1)
        # A transient message does not wait for anybody's disk.
        await asyncio.wait_for(replica.publish_in_order([Publish(b"passing")]), 1)

    asyncio.run(scenario())


def test_a_mirror_struck_from_the_record_no_longer_holds_confirms_back() -> None:
    async def scenario() -> None:
        replica = _durable_master(synchronised=("node2",))
        confirmed = replica.publish_in_order([Publish(b"keep me", persistent=True)])
        await asyncio.sleep(0.05)
        assert not confirmed.done()
        struck = QueueRecord("/", "q", master="node1", mirrors=(), synchronised_mirrors=(), version=1)
        replica.on_record(struck)
        await asyncio.wait_for(confirmed, 1)

    asyncio.run(scenario())


def test_a_mirror_that_says_it_is_synchronised_is_required_at_once() -> None:
    async def scenario() -> None:
        replica = _durable_master(synchronised=())
        replica._on_report("node2.bbbb", wire.encode(Synchronised("node2.bbbb")), 1)
        confirmed = replica.publish_in_order([Publish(b"keep me", persistent=True)])
        await asyncio.sleep(0.05)
        assert not confirmed.done(), "confirmed before the newly synchronised mirror's disk held it"
        replica._on_report("node2.bbbb", wire.encode(Persisted("node2.bbbb", FakeMember.id, 1)), 2)
        await asyncio.wait_for(confirmed, 1)
        assert replica.record.synchronised_mirrors == ("node2",)

    asyncio.run(scenario())


def test_a_mirror_is_marked_synchronised_only_once_its_disk_holds_what_was_confirmed_before() -> None:
    async def scenario() -> None:
        replica = _durable_master(synchronised=())
        await asyncio.wait_for(replica.publish_in_order([Publish(b"keep me", persistent=True)]), 1)
        replica._on_report("node2.bbbb", wire.encode(Synchronised("node2.bbbb")), 1)
        await asyncio.sleep(0.05)
        assert not replica.record.synchronised_mirrors, "marked before its disk held the confirmed message"
        replica._on_report("node2.bbbb", wire.encode(Persisted("node2.bbbb", FakeMember.id, 1)), 2)
        await asyncio.sleep(0.05)
        assert replica.record.synchronised_mirrors == ("node2",)

    asyncio.run(scenario())


def test_settling_transient_messages_changes_nothing_on_disk() -> None:
    """Found by the failover test: every acknowledgement on a durable queue counted as a disk change, so
    each ack step waited for the mirrors' disks although transient messages are never logged."""
    log = MemoryMessageLog()
    assert not persist_reports(log, [Enqueue(Message(1, b"transient")), Settle((1,))])
    assert persist_reports(log, [Enqueue(Message(2, b"kept", persistent=True))])
    assert persist_reports(log, [Settle((2,))])


class SayingMember(SequencedMember):
    """Also records what the replica says on the ring (unconfirmed broadcasts)."""

    def __init__(self) -> None:
        super().__init__()
        self.said: list[object] = []

    async def broadcast(self, bodies: list[bytes], confirmed: bool) -> tuple[int, int]:
        self.said.extend(wire.decode(body) for body in bodies)
        return 0, 0


def test_a_mirror_tells_a_new_master_how_far_its_disk_goes() -> None:
    """Found by the failover test: a mirror said Persisted only for sequence numbers above the last it
    had said, but a promoted master numbers its reports afresh, so its persistent confirms waited forever."""

    def enqueue(message_id: int) -> bytes:
        return wire.encode(Enqueue(Message(message_id, b"kept", persistent=True)))

    async def scenario() -> list[object]:
        replica = QueueReplica(CoordinatorHost(), QueueRecord("/", "q", master="node9", mirrors=("node1",)))
        member = SayingMember()
        replica.member = member  # type: ignore[assignment]
        replica.log = FakeLog()  # type: ignore[assignment]
        replica.committer = InstantCommitter()  # type: ignore[assignment]
        replica._on_member_event(GmDeliver("node9.old", 100, [enqueue(1)]))
        await asyncio.sleep(0.05)
        replica._on_member_event(GmDeliver("node2.new", 3, [enqueue(2)]))  # the promoted master's numbering
        await asyncio.sleep(0.05)
        return [said for said in member.said if isinstance(said, Persisted)]

    assert asyncio.run(scenario()) == [
        Persisted(FakeMember.id, "node9.old", 100),
        Persisted(FakeMember.id, "node2.new", 3),
    ]


class FullDisk:
    async def commit(self) -> None:
        raise OSError(28, "No space left on device")


def test_a_mirror_whose_disk_fails_drops_out_and_re_syncs() -> None:
    """The inconsistent-error rule (seed 002) for a mirror's disk: the master's write succeeded, the
    mirror's failed; the mirror must not say its disk holds anything, and it starts over."""

    async def scenario() -> tuple[list[object], QueueReplica]:
        replica = QueueReplica(CoordinatorHost(), QueueRecord("/", "q", master="node9", mirrors=("node1",)))
        member = SayingMember()
        replica.member = member  # type: ignore[assignment]
        mirror = replica.mirror
        assert mirror is not None
        mirror.member = member.id
        mirror.synchronised = True
        replica.log = FakeLog()  # type: ignore[assignment]
        replica.committer = FullDisk()  # type: ignore[assignment]
        replica.host.queue_dir = lambda record: "/nonexistent/ringq-test"  # type: ignore[method-assign]
        body = wire.encode(Enqueue(Message(1, b"kept", persistent=True)))
        replica._on_member_event(GmDeliver("node9.m", 1, [body]))
        await asyncio.sleep(0.05)
        return member.said, replica

    said, replica = asyncio.run(scenario())
    assert not any(isinstance(one, Persisted) for one in said)
    assert said == [Desynchronised(FakeMember.id), SyncRequest(FakeMember.id, 0)]
    assert replica.log is None and replica.mirror is not None and not replica.mirror.synchronised
    assert any("log failed" in event for event in replica.events)


def test_a_master_that_stops_answers_what_waited_for_its_mirrors_disks() -> None:
    """Found by the partition test (a master cut off, then recorded dead): a persistent publish waiting
    for the mirrors' disks was never answered when the master's member stopped."""

    async def scenario() -> None:
        replica = _durable_master(synchronised=("node2",))
        confirmed = replica.publish_in_order([Publish(b"keep me", persistent=True)])
        await asyncio.sleep(0.05)
        assert not confirmed.done()
        replica._on_member_event(Stopped("recorded dead"))
        with pytest.raises(ConnectionAbortedError, match="recorded dead"):
            await asyncio.wait_for(confirmed, 1)

    asyncio.run(scenario())


def test_a_newly_synchronised_mirror_writes_its_log_without_holding_the_event_loop(tmp_path: Path) -> None:
    """Found by measuring: a mirror that became synchronised wrote everything it held into its new log
    in one go (0.6 s for 100,000 messages), holding its event loop, and so the ring, all that time."""
    held = 3 * HOLDINGS_CHUNK + 10

    async def scenario() -> tuple[list[int], list[object], int]:
        host = CoordinatorHost()
        host.queue_dir = lambda record: str(tmp_path / "log")  # type: ignore[method-assign]
        record = QueueRecord("/", "q", durable=True, master="node9", mirrors=("node1",))
        replica = QueueReplica(host, record)
        member = SayingMember()
        replica.member = member  # type: ignore[assignment]
        mirror = replica.mirror
        assert mirror is not None
        mirror.member = member.id
        bodies = [wire.encode(Enqueue(Message(i, b"kept", persistent=True))) for i in range(1, held + 1)]
        replica._on_member_event(GmDeliver("node9.m", 1, bodies))
        turns = 0

        async def count_turns() -> None:
            nonlocal turns
            while replica.log is None:
                turns += 1
                await asyncio.sleep(0)

        counting = asyncio.ensure_future(count_turns())
        replica._on_member_event(GmDeliver("node9.m", held + 1, [wire.encode(Depth(held, epoch=1))]))
        assert replica.log is None, "the log must not be written in one go"
        # Applied while the log is written: they must follow it, in order.
        later = [wire.encode(Enqueue(Message(held + 1, b"later", persistent=True))), wire.encode(Settle((1,)))]
        replica._on_member_event(GmDeliver("node9.m", held + 2, later))
        await asyncio.wait_for(counting, 5)
        for _ in range(500):  # its group commit runs in a worker thread: wait for what it says after it
            if len(member.said) >= 2:
                break
            await asyncio.sleep(0.01)
        assert replica.log is not None
        replica.log.flush()
        return [i for i, _ in replica.log.recover()], member.said, turns

    ids, said, turns = asyncio.run(scenario())
    assert ids == list(range(2, held + 2))
    assert turns >= 3, f"the event loop ran {turns} times while {held} messages were written"
    assert [type(one) for one in said] == [Persisted, Synchronised]
