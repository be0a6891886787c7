"""Unit tests of the pure parts of ordered streams on nodes and in the coordinator: the fencing check
(services/stream/fencing.py), the group gates (services/stream/gates.py), batch checks
(services/stream/publish.py) and the coordinator's stream declaration and group observation
(services/coordinator/stream_service.py), on a memory store."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from ringq.v1 import stream_pb2
from services.coordinator import metadata, records, stream_records
from services.coordinator.metadata_service import now_ms
from services.coordinator.stream_service import declare_stream, delete_stream, observe_groups
from services.stream.fencing import FencingCheck, LeaseRead, StaleToken
from services.stream.gates import GroupGates
from services.stream.publish import batch_problem, outgoing, stream_seq
from tests.memory_store import MemoryStore


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _fencing(leases: dict[str, LeaseRead], clock: Clock, reads: list[str]) -> FencingCheck:
    async def read(name: str) -> LeaseRead:
        reads.append(name)
        return leases[name]

    return FencingCheck(read, clock)


def test_a_token_is_current_only_until_the_lease_read_ends_from_when_it_was_asked() -> None:
    clock, reads = Clock(), list[str]()
    leases = {"l": LeaseRead(token=3, holder="a", remaining_ms=1000)}
    fencing = _fencing(leases, clock, reads)
    asyncio.run(fencing.check("l", 3))
    assert fencing.current("l", 3) and reads == ["l"]
    clock.now += 0.999
    assert fencing.current("l", 3)
    clock.now += 0.002
    assert not fencing.current("l", 3)  # the coordinator may have handed the lease on by now
    leases["l"] = LeaseRead(token=4, holder="b", remaining_ms=1000)
    with pytest.raises(StaleToken, match="passed to token 4"):
        asyncio.run(fencing.check("l", 3))
    with pytest.raises(StaleToken, match="passed to token 4"):
        asyncio.run(fencing.check("l", 2))  # lower than one seen: refused without asking
    assert reads == ["l", "l"]


def test_a_missing_an_expired_or_an_unknown_token_is_refused() -> None:
    clock, reads = Clock(), list[str]()
    leases = {"l": LeaseRead(token=5, holder="a", remaining_ms=0)}
    fencing = _fencing(leases, clock, reads)
    with pytest.raises(StaleToken, match="no fencing token"):
        asyncio.run(fencing.check("l", 0))
    with pytest.raises(StaleToken, match="expired"):
        asyncio.run(fencing.check("l", 5))
    with pytest.raises(StaleToken, match="not current"):
        asyncio.run(fencing.check("l", 9))


def test_a_sealed_generation_takes_no_batch_and_the_seal_waits_for_those_in_flight() -> None:
    async def scenario() -> None:
        gates = GroupGates()
        key = ("/", "stream/s/1")
        gates.batch_started(key, 1)
        sealing = asyncio.ensure_future(gates.seal(key, 1))
        await asyncio.sleep(0.01)
        assert not sealing.done()  # a batch of generation 1 is still in flight
        assert not gates.open_for(key, 1) and gates.open_for(key, 2)
        gates.batch_started(key, 2)  # the next generation is not waited for
        gates.batch_ended(key, 1)
        await asyncio.wait_for(sealing, 1.0)

    asyncio.run(scenario())


def _batch(token: int, *ns: int, **headers: str) -> stream_pb2.PublishStreamRequest:
    return stream_pb2.PublishStreamRequest(
        fencing_token=token,
        messages=[stream_pb2.StreamMessage(stream_seq=(token << 32) | n, body=b"x", headers=headers) for n in ns],
    )


def test_batches_must_carry_their_token_and_increasing_seqs() -> None:
    assert batch_problem(_batch(2, 1, 2, 3), 0) is None
    assert "not above" in (batch_problem(_batch(2, 2, 2), 0) or "")
    assert "not above" in (batch_problem(_batch(2, 3), (2 << 32) | 3) or "")
    wrong = _batch(2, 1)
    wrong.fencing_token = 3
    assert "high 32 bits" in (batch_problem(wrong, 0) or "")
    assert "from 1" in (batch_problem(_batch(2, 0), 0) or "")
    assert "reserved" in (batch_problem(_batch(2, 1, **{"x-stream-seq": "9"}), 0) or "")
    assert "empty" in (batch_problem(stream_pb2.PublishStreamRequest(fencing_token=1), 0) or "")
    (item,) = outgoing(_batch(2, 7, trace="t"))
    assert (item.publisher, item.seq, item.headers) == ("stream:2", 7, {"trace": "t"})
    assert stream_seq(item.publisher, item.seq) == (2 << 32) | 7
    assert stream_seq("someone", 7) == 0


def _nodes(store: MemoryStore, *names: str) -> None:
    for name in names:
        records.register_node(store, name, f"127.0.0.1:{7000 + len(name)}")
        records.node_heartbeat(store, name, now_ms())


def test_a_stream_needs_two_nodes_and_spreads_its_groups_masters() -> None:
    store = MemoryStore()
    with pytest.raises(ValueError, match="needs two nodes"):
        declare_stream(store, "/", "s", 3, True, ["node1"], 10_000)
    _nodes(store, "node1", "node2", "node3")
    stream = declare_stream(store, "/", "s", 3, True, ["node1", "node2", "node3"], 10_000)
    queues = [metadata.get_queue(store, "/", group) for group in stream.groups]
    assert [q.master for q in queues] == ["node1", "node2", "node3"]
    assert all(len(q.mirrors) == 1 and q.mirrors[0] != q.master for q in queues)
    delete_stream(store, "/", "s")
    assert stream_records.list_streams(store) == []
    assert not any(metadata.list_queues(store))


def test_a_group_not_whole_leaves_the_send_list_at_the_next_pass() -> None:
    store = MemoryStore()
    _nodes(store, "node1", "node2", "node3")
    stream = declare_stream(store, "/", "s", 2, True, ["node1", "node2", "node3"], 10_000)
    for group in stream.groups:  # the mirrors caught up
        queue = metadata.get_queue(store, "/", group)
        metadata.update_queue(store, replace(queue, synchronised_mirrors=queue.mirrors), queue.version)
    observe_groups(store, 10_000)
    assert stream_records.get_stream(store, "/", "s").lists.send == stream.groups
    first = metadata.get_queue(store, "/", stream.groups[0])
    metadata.update_queue(store, replace(first, synchronised_mirrors=()), first.version)
    assert observe_groups(store, 10_000) == 1
    assert stream_records.get_stream(store, "/", "s").lists.send == stream.groups[1:]


def test_a_drained_report_keeps_the_highest_consumed_stream_seq_in_the_record() -> None:
    store = MemoryStore()
    stream = stream_records.declare_stream(store, "/", "s", 2, True)
    first, second = stream.groups
    stream_records.pick(store, "/", "s")  # first takes sends
    stream_records.change_lists(store, "/", "s", lambda lists: lists.replica_lost(first))
    stream_records.pick(store, "/", "s")  # second takes sends now
    after = stream_records.change_lists(store, "/", "s", lambda lists: lists.drained(first, 1, (1 << 32) | 9))
    assert after.lists.consume == (second,)
    assert stream_records.get_stream(store, "/", "s").lists.consumed_through == (1 << 32) | 9
    stale = stream_records.change_lists(store, "/", "s", lambda lists: lists.drained(first, 1, 5))
    assert stale.lists.consumed_through == (1 << 32) | 9, "an ignored report changes nothing"
