"""Queue records, policies applied live, and leases over a Store (services/coordinator/metadata.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import pytest

from services.coordinator import metadata
from services.coordinator.leases import LeaseRefused
from services.coordinator.metadata import Conflict, NotFound, QueueMismatch, QueueRecord
from services.coordinator.placement_trigger import PassStart
from services.coordinator.policies import Policy, PolicyError
from services.coordinator.store import Record
from tests.memory_store import MemoryStore

NODES = ["n1", "n2", "n3"]


def _declare(store: MemoryStore, name: str = "orders", **kwargs: object) -> QueueRecord:
    return metadata.declare_queue(store, QueueRecord("/", name, durable=True, **kwargs), NODES)  # type: ignore[arg-type]


def test_a_queue_without_policy_has_a_master_and_no_mirrors() -> None:
    store = MemoryStore()
    queue = _declare(store)
    assert queue.master in NODES and queue.mirrors == () and queue.policy == ""
    assert queue.version == 1 and queue.gm_group.startswith("queue.")
    assert metadata.get_queue(store, "/", "orders") == queue


def test_declaring_again_returns_the_queue_and_a_different_declaration_is_refused() -> None:
    store = MemoryStore()
    first = _declare(store)
    assert _declare(store) == first
    with pytest.raises(QueueMismatch) as refused:
        metadata.declare_queue(store, QueueRecord("/", "orders", durable=False), NODES)
    assert refused.value.field == "durable" and "durable=True" in str(refused.value)


def test_the_effective_policy_places_a_new_queue() -> None:
    store = MemoryStore()
    metadata.set_policy(store, Policy("/", "two", "^ha\\.", {"ha-mode": "exactly", "ha-params": 2}), NODES)
    queue = _declare(store, "ha.orders")
    assert queue.policy == "two" and len(queue.mirrors) == 1 and queue.master not in queue.mirrors
    assert _declare(store, "plain").mirrors == ()


def test_an_exclusive_queue_is_never_mirrored_whatever_its_policy() -> None:
    """An exclusive queue belongs to its owner on one node (RabbitMQ never mirrors them); its policy's
    ha-* keys are dropped, or a floor of synchronised mirrors it can never have would hold its confirms."""
    store = MemoryStore()
    metadata.set_policy(store, Policy("/", "all", "^ha\\.", {"ha-mode": "all", "max-length": 5}), NODES)
    queue = _declare(store, "ha.mine", exclusive_owner="session-1")
    assert queue.mirrors == () and queue.policy == "all"
    assert "ha-mode" not in queue.policy_definition and queue.policy_definition["max-length"] == 5


def test_policies_apply_live_to_existing_queues() -> None:
    store = MemoryStore()
    queue = _declare(store, "ha.q")
    everywhere = Policy("/", "all", "^ha\\.", {"ha-mode": "all"})
    _, changed = metadata.set_policy(store, everywhere, NODES)
    queue_now = metadata.get_queue(store, "/", "ha.q")
    assert changed == 1 and queue_now.master == queue.master and set(queue_now.mirrors) == set(NODES) - {queue.master}
    _, changed = metadata.set_policy(
        store, replace(everywhere, definition={"ha-mode": "exactly", "ha-params": 2}), NODES
    )
    shrunk = metadata.get_queue(store, "/", "ha.q")
    assert changed == 1 and shrunk.mirrors == queue_now.mirrors[:1], "the newest mirror goes first"
    assert metadata.clear_policy(store, "/", "all", NODES) == 1
    assert metadata.get_queue(store, "/", "ha.q").mirrors == ()
    with pytest.raises(NotFound):
        metadata.clear_policy(store, "/", "all", NODES)


def test_a_policy_change_counts_the_queues_it_changed_even_when_another_pass_applied_it_first() -> None:
    """Found in CI: SetPolicy answered queues_changed=0 for a queue it had mirrored, because the placement
    loop's pass read the new policy and rewrote the record before SetPolicy's own pass ran. The count
    compares each queue with how it stood before the change was stored, not with what one pass wrote."""
    store = MemoryStore()
    _declare(store, "ha.q")
    _declare(store, "plain")
    before = metadata.policy_outcomes(store)
    metadata.save_policy(store, Policy("/", "all", "^ha\\.", {"ha-mode": "all"}))
    assert metadata.apply_policies(store, "", NODES) == 1  # the placement loop's pass, first
    after = metadata.place_queues(store, "", NODES).queues  # the policy change's own pass writes nothing
    assert metadata.apply_policies(store, "", NODES) == 0
    assert metadata.queues_changed(before, after) == 1
    before = metadata.policy_outcomes(store)
    metadata.delete_policy(store, "/", "all")
    metadata.apply_policies(store, "", NODES)
    assert metadata.queues_changed(before, metadata.place_queues(store, "", NODES).queues) == 1
    assert metadata.get_queue(store, "/", "ha.q").mirrors == ()


def test_a_queue_declared_during_a_policy_change_is_not_counted_as_changed() -> None:
    store = MemoryStore()
    before = metadata.policy_outcomes(store)
    _, changed = metadata.set_policy(store, Policy("/", "all", "^ha\\.", {"ha-mode": "all"}), NODES)
    _declare(store, "ha.new")
    assert changed == 0
    assert metadata.queues_changed(before, metadata.place_queues(store, "", NODES).queues) == 0


def test_a_queue_whose_master_is_not_live_keeps_its_placement() -> None:
    """The coordinator re-places queues when nodes come and go, but never picks a new master: the
    queue's replicas promote the eldest synchronised mirror (or recover from the log that knows most)."""
    store = MemoryStore()
    metadata.set_policy(store, Policy("/", "all", "^ha\\.", {"ha-mode": "all"}), NODES)
    queue = _declare(store, "ha.q")
    others = [n for n in NODES if n != queue.master]
    assert metadata.apply_policies(store, "", others) == 0
    assert metadata.get_queue(store, "/", "ha.q").master == queue.master
    # With the master live, a node that left loses its mirror, and gets it back when it returns.
    assert metadata.apply_policies(store, "", [queue.master, others[0]]) == 1
    assert metadata.get_queue(store, "/", "ha.q").mirrors == (others[0],)
    assert metadata.apply_policies(store, "", NODES) == 1
    assert set(metadata.get_queue(store, "/", "ha.q").mirrors) == set(others)


def test_a_synchronised_mirror_whose_node_is_down_stays_until_its_master_strikes_it() -> None:
    """Found by tests/sim/queue_sim.py (seed 20784): after a restart of every node the master's node was
    back first; placement dropped a synchronised mirror whose node was not yet, and the recovery that
    followed did not wait for that mirror's log, which alone still held two confirmed messages."""
    store = MemoryStore()
    metadata.set_policy(store, Policy("/", "all", "^ha\\.", {"ha-mode": "all"}), NODES)
    queue = _declare(store, "ha.q")
    down = queue.mirrors[0]
    metadata.update_queue(store, replace(queue, synchronised_mirrors=(down,)), queue.version)
    metadata.apply_policies(store, "", [n for n in NODES if n != down])
    kept = metadata.get_queue(store, "/", "ha.q")
    assert down in kept.mirrors and kept.synchronised_mirrors == (down,)
    # An unsynchronised mirror on a node that is down makes way as before.
    unsynchronised = next(n for n in kept.mirrors if n != down)
    metadata.apply_policies(store, "", [kept.master, down])
    assert unsynchronised not in metadata.get_queue(store, "/", "ha.q").mirrors


def test_the_highest_priority_policy_wins() -> None:
    store = MemoryStore()
    metadata.set_policy(store, Policy("/", "low", ".*", {"ha-mode": "all"}, priority=0), NODES)
    metadata.set_policy(store, Policy("/", "high", "^q", {"max-length": 10}, priority=5), NODES)
    queue = _declare(store, "q1")
    assert queue.policy == "high" and queue.policy_definition == {"max-length": 10} and queue.mirrors == ()


def test_a_refused_policy_is_not_stored() -> None:
    store = MemoryStore()
    with pytest.raises(PolicyError) as refused:
        metadata.set_policy(store, Policy("/", "bad", "^q", {"ha-mod": "all"}), NODES)
    assert refused.value.key == "ha-mod"
    assert metadata.list_policies(store) == []


def test_removed_mirrors_leave_the_synchronised_set() -> None:
    store = MemoryStore()
    metadata.set_policy(store, Policy("/", "all", ".*", {"ha-mode": "all"}), NODES)
    queue = _declare(store, "q")
    synced = metadata.update_queue(store, replace(queue, synchronised_mirrors=queue.mirrors), queue.version)
    metadata.set_policy(store, Policy("/", "all", ".*", {"ha-mode": "exactly", "ha-params": 2}), NODES)
    after = metadata.get_queue(store, "/", "q")
    assert after.synchronised_mirrors == after.mirrors == synced.mirrors[:1]


def test_queue_updates_and_deletes_are_compare_and_set() -> None:
    store = MemoryStore()
    queue = _declare(store)
    metadata.update_queue(store, replace(queue, master="n3"), queue.version)
    with pytest.raises(Conflict):
        metadata.update_queue(store, replace(queue, master="n2"), queue.version)
    with pytest.raises(Conflict):
        metadata.delete_queue(store, "/", "orders", expected_version=queue.version)
    metadata.delete_queue(store, "/", "orders")
    with pytest.raises(NotFound):
        metadata.get_queue(store, "/", "orders")


def test_queue_keys_do_not_collide_across_vhosts() -> None:
    store = MemoryStore()
    metadata.declare_queue(store, QueueRecord("a/b", "c"), NODES)
    metadata.declare_queue(store, QueueRecord("a", "b/c", durable=True), NODES)
    assert [(q.vhost, q.name) for q in metadata.list_queues(store)] == [("a", "b/c"), ("a/b", "c")]


def test_leases_through_the_store() -> None:
    store = MemoryStore()
    lease = metadata.acquire_lease(store, "stream/s/producer", "p1", 1000, now_ms=0)
    assert lease.token == 1
    with pytest.raises(LeaseRefused):
        metadata.acquire_lease(store, "stream/s/producer", "p2", 1000, now_ms=10)
    metadata.renew_lease(store, "stream/s/producer", "p1", 1, 1000, now_ms=900)
    taken = metadata.acquire_lease(store, "stream/s/producer", "p2", 1000, now_ms=2000)
    assert taken.token == 2 and metadata.get_lease(store, "stream/s/producer").holder == "p2"
    with pytest.raises(LeaseRefused, match="stale fencing token 1"):
        metadata.release_lease(store, "stream/s/producer", "p1", 1, now_ms=2001)
    assert [lease.name for lease in metadata.list_leases(store)] == ["stream/s/producer"]


def test_concurrent_contenders_get_the_lease_exactly_once() -> None:
    store = MemoryStore()
    winners: list[str] = []
    start = threading.Barrier(8)

    def contend(holder: str) -> None:
        start.wait()
        try:
            metadata.acquire_lease(store, "l", holder, 10_000, now_ms=0)
            winners.append(holder)
        except LeaseRefused:
            pass

    threads = [threading.Thread(target=contend, args=(f"p{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(winners) == 1 and metadata.get_lease(store, "l").holder == winners[0]


# ------------------------------------------------------------------------------ placement passes


class CountingStore(MemoryStore):
    """A MemoryStore that counts its calls, and can lose one compare-and-set to a concurrent writer."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {"get": 0, "list": 0, "put": 0}
        self.before_next_put: Callable[[], None] | None = None

    def get(self, kind: str, key: str) -> Record | None:
        self.calls["get"] += 1
        return super().get(kind, key)

    def list(self, kind: str) -> list[Record]:
        self.calls["list"] += 1
        return super().list(kind)

    def put(self, kind: str, key: str, value: Mapping[str, Any], expected_version: int) -> Record | None:
        self.calls["put"] += 1
        interfere, self.before_next_put = self.before_next_put, None
        if interfere is not None:
            interfere()
        return super().put(kind, key, value, expected_version)


def _placed_queues(store: MemoryStore, count: int, master: str = "n1") -> list[QueueRecord]:
    return [
        metadata.update_queue(store, replace(queue, master=master, mirrors=()), queue.version)
        for queue in (_declare(store, f"q{index}") for index in range(count))
    ]


def test_a_pass_reads_the_queues_once_and_writes_nothing_when_all_is_placed() -> None:
    """One listing per pass, not one per queue (a pass over 5,000 queues re-listed them 5,000 times)."""
    store = CountingStore()
    metadata.set_policy(store, Policy("/", "all", ".*", {"ha-mode": "all"}), NODES)
    _placed_queues(store, 50)
    metadata.apply_policies(store, "", NODES)
    store.calls = dict.fromkeys(store.calls, 0)
    done = metadata.place_queues(store, "", NODES)
    assert done.written == {} and len(done.queues) == 50
    assert store.calls == {"get": 0, "list": 2, "put": 0}, "the policies and the queues, each listed once"


def test_a_pass_spreads_new_mirrors_by_the_load_as_it_moves() -> None:
    store = MemoryStore()
    nodes = ["n1", "n2", "n3", "n4", "n5"]
    _placed_queues(store, 8)  # every master on n1
    metadata.set_policy(store, Policy("/", "two", ".*", {"ha-mode": "exactly", "ha-params": 2}), nodes)
    mirrors = [queue.mirrors for queue in metadata.list_queues(store)]
    assert sorted(mirror for (mirror,) in mirrors) == ["n2", "n2", "n3", "n3", "n4", "n4", "n5", "n5"]


def test_a_pass_counts_the_replicas_of_every_vhost() -> None:
    store = MemoryStore()
    metadata.declare_queue(store, QueueRecord("other", "busy"), ["n2"])  # n2 holds a replica elsewhere
    queue = _placed_queues(store, 1)[0]
    metadata.set_policy(store, Policy("/", "two", ".*", {"ha-mode": "exactly", "ha-params": 2}), NODES)
    assert metadata.get_queue(store, "/", queue.name).mirrors == ("n3",)


def test_a_pass_re_reads_a_queue_that_changed_under_it() -> None:
    store = CountingStore()
    queue = _placed_queues(store, 1)[0]
    metadata.set_policy(store, Policy("/", "all", "^nothing$", {"ha-mode": "all"}), NODES)
    metadata.set_policy(store, Policy("/", "all", ".*", {"ha-mode": "all"}), ["n1"])  # no mirror yet

    def synchronise_meanwhile() -> None:
        current = metadata.get_queue(store, "/", queue.name)
        metadata.update_queue(store, replace(current, master_epoch=7), current.version)

    store.before_next_put = synchronise_meanwhile
    done = metadata.place_queues(store, "", NODES)
    after = metadata.get_queue(store, "/", queue.name)
    assert after.mirrors == ("n2", "n3") and after.master_epoch == 7, "placed over the concurrent change"
    assert done.written == {after.key: after.version} and done.queues[after.key] == after


def test_unproven_nodes_keep_their_replicas_but_get_no_new_one() -> None:
    store = MemoryStore()
    metadata.set_policy(store, Policy("/", "all", "^all", {"ha-mode": "all"}), NODES)
    metadata.set_policy(store, Policy("/", "two", "^two", {"ha-mode": "exactly", "ha-params": 2}), NODES)
    kept = metadata.declare_queue(store, QueueRecord("/", "all.kept"), NODES, preferred_master="n1")
    assert kept.mirrors == ("n2", "n3")
    metadata.update_queue(store, replace(kept, name="all.struck", mirrors=("n2",)), 0)
    short = metadata.declare_queue(store, QueueRecord("/", "two.short"), ["n1"], preferred_master="n1")
    assert short.mirrors == ()
    done = metadata.place_queues(store, "", NODES, unproven_nodes={"n3"})
    assert metadata.get_queue(store, "/", "all.kept").mirrors == ("n2", "n3"), "n3 keeps what it holds"
    assert metadata.get_queue(store, "/", "all.struck").mirrors == ("n2",), "no new replica on n3 yet"
    assert metadata.get_queue(store, "/", "two.short").mirrors == ("n2",), "another node instead"
    assert set(done.written) == {short.key}
    metadata.place_queues(store, "", NODES)  # n3 has proven itself alive
    assert metadata.get_queue(store, "/", "all.struck").mirrors == ("n2", "n3")


def _struck_while_a_pass_reads() -> tuple[MemoryStore, PassStart]:
    """A queue on n1 and n2 (ha-mode exactly 2), and n2 struck just after a pass took its start."""
    store = MemoryStore()
    metadata.set_policy(store, Policy("/", "two", "^two", {"ha-mode": "exactly", "ha-params": 2}), NODES)
    queue = metadata.declare_queue(store, QueueRecord("/", "two.q"), NODES, preferred_master="n1")
    assert queue.mirrors == ("n2",)
    start = PassStart(frozenset(), {queue.key: (queue.version, queue.replicas)})
    metadata.update_queue(store, replace(queue, mirrors=()), queue.version)
    return store, start


def test_a_strike_the_pass_reads_before_its_trigger_saw_it_puts_the_replica_elsewhere() -> None:
    """Regression (a flaky tests/test_coordinator_placement_loop.py): a master struck n2 from a queue
    while a pass was reading the records, so the pass's trigger had not seen the strike; with nothing
    telling it otherwise, the pass put the replica straight back on n2 (dead, but alive by heartbeat for
    the liveness timeout). Each record is now compared with the version the trigger knew."""
    blind, start = _struck_while_a_pass_reads()
    metadata.place_queues(blind, "", NODES, start.unproven)
    assert metadata.get_queue(blind, "/", "two.q").mirrors == ("n2",), "without the comparison: back on n2"

    store, start = _struck_while_a_pass_reads()

    def unseen(record: QueueRecord) -> frozenset[str]:
        return start.unseen_strikes(record.key, record.version, record.replicas)

    metadata.place_queues(store, "", NODES, start.unproven, unseen)
    assert metadata.get_queue(store, "/", "two.q").mirrors == ("n3",)


class _CountingStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.queue_listings = 0

    def list(self, kind: str) -> Any:
        if kind == metadata.QUEUE:
            self.queue_listings += 1
        return super().list(kind)


def test_declares_through_a_load_cache_list_the_queues_once_per_interval_and_still_balance() -> None:
    """Found by review: each declare listed every queue to count the replica load, so declaring N queues
    cost O(N^2): 10,000 stalled at 4,622 after 330 s."""
    store, now = _CountingStore(), [0.0]
    cache = metadata.ReplicaLoadCache(max_age_s=1.0, clock=lambda: now[0])
    metadata.set_policy(
        store, Policy(vhost="/", name="two", pattern=".*", definition={"ha-mode": "exactly", "ha-params": 2}), NODES
    )
    listed_before = store.queue_listings
    for i in range(30):
        metadata.declare_queue(store, QueueRecord("/", f"q{i}"), NODES, load_cache=cache)
    assert store.queue_listings - listed_before == 1
    load = metadata.replica_load(metadata.list_queues(store))
    assert sorted(load.values()) == [20, 20, 20], "counted forward, the cache balanced as a fresh listing would"
    now[0] = 1.0
    metadata.declare_queue(store, QueueRecord("/", "late"), NODES, load_cache=cache)
    assert store.queue_listings - listed_before == 3  # one listing by the test, one refresh


def test_a_queue_without_a_bound_of_its_own_gets_the_default_one() -> None:
    """No queue is unbounded: without max-length or max-length-bytes in its policy a queue holds at most
    DEFAULT_MAX_LENGTH_BYTES and then refuses publishes (REJECTED); a policy's own bound replaces it,
    and a policy's overflow is kept."""
    store = MemoryStore()
    default = metadata.DEFAULT_MAX_LENGTH_BYTES
    unbounded = _declare(store, "plain")
    assert unbounded.policy == "" and unbounded.mirrors == ()
    assert unbounded.policy_definition == {"max-length-bytes": default, "overflow": "reject-publish"}
    metadata.set_policy(store, Policy("/", "ha", "^ha", {"ha-mode": "all", "overflow": "drop-head"}), NODES)
    mirrored = _declare(store, "ha.q")
    assert mirrored.policy_definition == {"ha-mode": "all", "overflow": "drop-head", "max-length-bytes": default}
    assert len(mirrored.mirrors) == len(NODES) - 1, "the bound changes no placement"
    metadata.set_policy(store, Policy("/", "small", "^small", {"max-length": 5}), NODES)
    assert _declare(store, "small.q").policy_definition == {"max-length": 5}


def test_a_stream_group_has_exactly_two_replicas_whatever_the_policies_say() -> None:
    store = MemoryStore()
    metadata.set_policy(store, Policy("/", "all", ".*", {"ha-mode": "all"}), NODES)
    group = _declare(store, "stream/orders/1")
    assert group.policy == "stream-group" and len(group.mirrors) == 1 and group.master not in group.mirrors
    assert group.policy_definition["ha-min-synchronised"] == 1
