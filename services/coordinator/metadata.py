"""Queue records, policies and leases kept in a Store: the coordinator's metadata rules.

Responsible for: declaring queues (placed by their effective policy on the
live, non-draining nodes), placement passes (`place_queues`: re-applying the
policies to every queue, when a policy is set or cleared and whenever the
coordinator's placer finds one due), compare-and-set updates of queue
records, and storing lease transitions (rules in leases.py).

Guarantees: every write is a compare-and-set on the record's version and is
retried from a fresh read on a conflict (bounded), so concurrent
coordinators never lose an update; a policy that fails validation is never
stored; a placement pass never moves a live master (placement.py), drops
removed mirrors from the synchronised set, keeps master_epoch and every other
field as they are, writes only the records whose placement or policy changed,
and costs one listing of the queues however many there are; a lease
transition is computed from the lease as stored, so two contenders never both
hold it.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeVar
from urllib.parse import quote

from ringq.names import check_name
from services.coordinator import leases, placement, policies
from services.coordinator.leases import Lease
from services.coordinator.policies import Policy
from services.coordinator.store import Record, Store
from services.coordinator.stream_groups import GROUP_DEFINITION, is_stream_group

QUEUE = "queue"
POLICY = "policy"
LEASE = "lease"
CAS_ATTEMPTS = 20
REPLICATION_LEVELS = ("none", "wiring", "all")
T = TypeVar("T")


class NotFound(LookupError):
    """The record does not exist."""


class QueueLimit(Exception):
    """A vhost has as many queues as it may have."""


class Conflict(Exception):
    """A compare-and-set lost to a concurrent change (or kept losing)."""


class QueueMismatch(ValueError):
    """A queue was re-declared with different properties; `field` names the first."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# A queue's GM group is named QUEUE_GROUP_PREFIX + a random id; applications may not join such groups.
QUEUE_GROUP_PREFIX = "queue."


@dataclass(frozen=True)
class QueueRecord:
    """What the coordinator knows of a queue (mirrors ringq.v1.QueueRecord)."""

    vhost: str
    name: str
    durable: bool = False
    auto_delete: bool = False
    exclusive_owner: str = ""
    arguments: Mapping[str, str] = field(default_factory=dict)
    master: str = ""
    mirrors: tuple[str, ...] = ()
    synchronised_mirrors: tuple[str, ...] = ()
    policy: str = ""
    policy_definition: Mapping[str, Any] = field(default_factory=dict)
    gm_group: str = ""
    replication: str = "all"
    # node -> "EPOCH.SEQ": how far the log of each replica that came back goes, while
    # the master's node is away (services/queue/durability.py); empty otherwise.
    recovery_positions: Mapping[str, str] = field(default_factory=dict)
    # The current master's term: raised by one, by compare-and-set, at every change of master.
    master_epoch: int = 0
    version: int = 0

    @property
    def key(self) -> str:
        return queue_key(self.vhost, self.name)

    @property
    def replicas(self) -> frozenset[str]:
        """The nodes holding a replica: the master and the mirrors."""
        return frozenset(node for node in (self.master, *self.mirrors) if node)


def queue_key(vhost: str, name: str) -> str:
    """The store key of a queue: both parts quoted, so no two queues share one."""
    return f"{quote(vhost, safe='')}/{quote(name, safe='')}"


def queue_value(queue: QueueRecord) -> dict[str, Any]:
    """The store value of a queue record (everything but its version)."""
    value = asdict(queue)
    del value["version"]
    value["mirrors"] = list(queue.mirrors)
    value["synchronised_mirrors"] = list(queue.synchronised_mirrors)
    value["arguments"] = dict(queue.arguments)
    value["policy_definition"] = dict(queue.policy_definition)
    value["recovery_positions"] = dict(queue.recovery_positions)
    return value


def queue_from_record(record: Record) -> QueueRecord:
    v = record.value
    return QueueRecord(
        vhost=v["vhost"],
        name=v["name"],
        durable=v["durable"],
        auto_delete=v["auto_delete"],
        exclusive_owner=v["exclusive_owner"],
        arguments=dict(v["arguments"]),
        master=v["master"],
        mirrors=tuple(v["mirrors"]),
        synchronised_mirrors=tuple(v["synchronised_mirrors"]),
        policy=v["policy"],
        policy_definition=dict(v["policy_definition"]),
        gm_group=v["gm_group"],
        replication=v["replication"],
        recovery_positions=dict(v.get("recovery_positions", {})),
        master_epoch=int(v.get("master_epoch", 0)),
        version=record.version,
    )


def _policy_key(vhost: str, name: str) -> str:
    return f"{quote(vhost, safe='')}/{quote(name, safe='')}"


def policy_from_record(record: Record) -> Policy:
    v = record.value
    return Policy(v["vhost"], v["name"], v["pattern"], dict(v["definition"]), v["priority"], v["apply_to"])


def retry_until_set(step: Callable[[], T | None]) -> T:
    """Run a read-decide-write step until its compare-and-set succeeds."""
    for _ in range(CAS_ATTEMPTS):
        result = step()
        if result is not None:
            return result
    raise Conflict(f"gave up after {CAS_ATTEMPTS} conflicting concurrent changes")


# ------------------------------------------------------------------- queues


def get_queue(store: Store, vhost: str, name: str) -> QueueRecord:
    record = store.get(QUEUE, queue_key(vhost, name))
    if record is None:
        raise NotFound(f"no queue {name!r} in vhost {vhost!r}")
    return queue_from_record(record)


def list_queues(store: Store, vhost: str = "") -> list[QueueRecord]:
    queues = [queue_from_record(r) for r in store.list(QUEUE)]
    return sorted((q for q in queues if not vhost or q.vhost == vhost), key=lambda q: (q.vhost, q.name))


def replica_load(queues: Iterable[QueueRecord]) -> dict[str, int]:
    """How many replicas (masters and mirrors) of `queues` each node holds."""
    load: dict[str, int] = {}
    for queue in queues:
        _count_replicas(load, queue, 1)
    return load


class ReplicaLoadCache:
    """Replicas per node for placing new queues: listed from the store at most once per `max_age_s`
    and counted forward with every queue placed through it meanwhile. Placement only balances with
    it (a load a second old misplaces nothing), and listing every queue on every declare made
    declaring N queues cost O(N^2): 10,000 stalled at 4,622 after 330 s. Thread-safe (declares run
    in worker threads)."""

    def __init__(self, max_age_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age_s = max_age_s
        self.clock = clock
        self._lock = threading.Lock()
        self._load: dict[str, int] = {}
        self._per_vhost: dict[str, int] = {}
        self._listed_at = float("-inf")

    def _refresh(self, store: Store) -> None:
        if self.clock() - self._listed_at >= self.max_age_s:
            queues = list_queues(store)
            self._load = replica_load(queues)
            self._per_vhost = {}
            for queue in queues:
                self._per_vhost[queue.vhost] = self._per_vhost.get(queue.vhost, 0) + 1
            self._listed_at = self.clock()

    def load(self, store: Store) -> dict[str, int]:
        with self._lock:
            self._refresh(store)
            return dict(self._load)

    def queues_in(self, store: Store, vhost: str) -> int:
        """How many queues `vhost` has (as listed at most `max_age_s` ago, plus those placed since)."""
        with self._lock:
            self._refresh(store)
            return self._per_vhost.get(vhost, 0)

    def placed(self, queue: QueueRecord) -> None:
        """`queue` was just created with its replicas."""
        with self._lock:
            _count_replicas(self._load, queue, 1)
            self._per_vhost[queue.vhost] = self._per_vhost.get(queue.vhost, 0) + 1


def _count_replicas(load: dict[str, int], queue: QueueRecord, sign: int) -> None:
    for node in queue.replicas:
        load[node] = load.get(node, 0) + sign


# A queue whose policy bounds it neither in messages nor in bytes holds at most this many bytes of
# messages; past it, publishes are answered REJECTED (overflow reject-publish, unless the policy chose
# another overflow). A policy with max-length or max-length-bytes replaces it.
DEFAULT_MAX_LENGTH_BYTES = 2 * 1024**3


def with_default_bound(definition: dict[str, Any]) -> dict[str, Any]:
    """`definition` bounded by DEFAULT_MAX_LENGTH_BYTES if it sets no bound of its own."""
    if "max-length" in definition or "max-length-bytes" in definition:
        return definition
    return {
        **definition,
        "max-length-bytes": DEFAULT_MAX_LENGTH_BYTES,
        "overflow": definition.get("overflow", "reject-publish"),
    }


def _placed(
    queue: QueueRecord,
    all_policies: Sequence[Policy],
    live_nodes: Sequence[str],
    load: Mapping[str, int],
    unproven_nodes: Collection[str] = (),
) -> QueueRecord:
    """`queue` with its effective policy and placement recomputed.

    `unproven_nodes` keep the replicas of `queue` they hold but get no new one.
    """
    effective = policies.effective_policy(queue.vhost, queue.name, all_policies)
    if is_stream_group(queue.name):  # a stream's group: two replicas, whatever the policies say
        effective = Policy(queue.vhost, "stream-group", "", dict(GROUP_DEFINITION), policies.MAX_PRIORITY)
    definition = with_default_bound(dict(effective.definition) if effective else {})
    if queue.exclusive_owner:  # an exclusive queue is its owner's alone, on one node: never mirrored
        definition = {key: value for key, value in definition.items() if not key.startswith("ha-")}
    replication = str(definition.get("replication", "all"))
    if queue.master and queue.master not in live_nodes:
        # A lost master is replaced by the queue's own replicas, which know which mirror is
        # synchronised (and a returning master's node may still recover it): leave the placement.
        return replace(
            queue, policy=effective.name if effective else "", policy_definition=definition, replication=replication
        )
    current = placement.Placement(queue.master, queue.mirrors) if queue.master else None
    candidates = [node for node in live_nodes if node not in unproven_nodes or node in queue.replicas] or live_nodes
    # A synchronised mirror is struck from the record only by its queue's master, which sees its ring member
    # die; placement keeps it while its node is not live, so that after a restart of every node the replicas
    # still know whose log to wait for before electing one (services/queue/durability.py).
    kept = [m for m in queue.synchronised_mirrors if m in queue.mirrors and m not in candidates]
    candidates = [*candidates, *kept]
    if replication == "none" or effective is None or queue.exclusive_owner:
        definition_for_placement: Mapping[str, Any] | None = None
    else:
        definition_for_placement = dict(effective.definition) or None
    placed = placement.place(
        definition_for_placement, candidates, current, preferred_master=queue.master or None, load=load
    )
    synchronised = tuple(m for m in queue.synchronised_mirrors if m in placed.mirrors)
    return replace(
        queue,
        master=placed.master,
        mirrors=placed.mirrors,
        synchronised_mirrors=synchronised,
        policy=effective.name if effective else "",
        policy_definition=definition,
        replication=replication,
    )


def declare_queue(
    store: Store,
    declared: QueueRecord,
    live_nodes: Sequence[str],
    preferred_master: str = "",
    load_cache: ReplicaLoadCache | None = None,
    max_queues_per_vhost: int | None = None,
) -> QueueRecord:
    """Create `declared` (placed by its effective policy), or return the existing
    queue if it has the same properties; QueueMismatch if they differ; QueueLimit if its vhost has
    `max_queues_per_vhost` queues already. The replica load that balances placement comes from
    `load_cache` if given (else from listing every queue)."""
    _check_names(declared)

    def step() -> QueueRecord | None:
        existing = store.get(QUEUE, declared.key)
        if existing is not None:
            queue = queue_from_record(existing)
            for name in ("durable", "auto_delete", "exclusive_owner", "arguments"):
                if getattr(queue, name) != getattr(declared, name):
                    raise QueueMismatch(
                        name,
                        f"queue {declared.name!r} exists with {name}={getattr(queue, name)!r}, "
                        f"declared with {getattr(declared, name)!r}",
                    )
            return queue
        if max_queues_per_vhost is not None:
            count = (
                load_cache.queues_in(store, declared.vhost)
                if load_cache is not None
                else len(list_queues(store, declared.vhost))
            )
            if count >= max_queues_per_vhost:
                raise QueueLimit(
                    f"vhost {declared.vhost!r} has {count} queues, the most it may have "
                    f"(ringq coordinator --max-queues-per-vhost {max_queues_per_vhost})"
                )
        fresh = replace(declared, master=preferred_master if preferred_master in live_nodes else "", mirrors=())
        fresh = replace(fresh, gm_group=f"{QUEUE_GROUP_PREFIX}{uuid.uuid4().hex}")
        load = load_cache.load(store) if load_cache is not None else replica_load(list_queues(store))
        placed = _placed(fresh, list_policies(store, declared.vhost), live_nodes, load)
        written = store.put(QUEUE, declared.key, queue_value(placed), 0)
        if written is None:
            return None
        created = queue_from_record(written)
        if load_cache is not None:
            load_cache.placed(created)
        return created

    return retry_until_set(step)


def update_queue(store: Store, queue: QueueRecord, expected_version: int) -> QueueRecord:
    """Replace a queue record if its version is `expected_version`; Conflict otherwise. The record
    must name a group: a queue's replicas meet in the group its declaration gave it."""
    _check_names(queue)
    if not queue.gm_group:
        raise ValueError("gm_group must not be empty: a queue keeps the group it was declared with")
    written = store.put(QUEUE, queue.key, queue_value(queue), expected_version)
    if written is None:
        if store.get(QUEUE, queue.key) is None:
            raise NotFound(f"no queue {queue.name!r} in vhost {queue.vhost!r}")
        raise Conflict(f"queue {queue.name!r} changed since version {expected_version}")
    return queue_from_record(written)


def _check_names(queue: QueueRecord) -> None:
    """InvalidName (a ValueError) unless the record's vhost, name and group name follow ringq.names."""
    check_name("vhost", queue.vhost)
    check_name("name", queue.name)
    if queue.gm_group:
        check_name("gm_group", queue.gm_group)


def delete_queue(store: Store, vhost: str, name: str, expected_version: int = 0) -> None:
    """Delete a queue record (at `expected_version`, or whatever its version if 0)."""
    key = queue_key(vhost, name)

    def step() -> bool | None:
        record = store.get(QUEUE, key)
        if record is None:
            raise NotFound(f"no queue {name!r} in vhost {vhost!r}")
        if expected_version and record.version != expected_version:
            raise Conflict(f"queue {name!r} is at version {record.version}, not {expected_version}")
        return True if store.delete(QUEUE, key, record.version) else None

    retry_until_set(step)


@dataclass(frozen=True)
class PlacementPass:
    """What one pass of `place_queues` left behind."""

    # Every queue of the pass as it stands after it (as read, or as this pass wrote it), by key.
    queues: Mapping[str, QueueRecord]
    # The version this pass wrote, by key, for the queues it changed.
    written: Mapping[str, int]


def place_queues(
    store: Store,
    vhost: str,
    live_nodes: Sequence[str],
    unproven_nodes: Collection[str] = (),
    also_unproven: Callable[[QueueRecord], Collection[str]] | None = None,
) -> PlacementPass:
    """Re-apply the vhost's policies (every vhost's if `vhost` is empty) to each of its queues,
    placing them on `live_nodes`; a queue whose master is not live keeps its placement, and
    `unproven_nodes` keep the replicas they hold but get no new one; so do, for one queue,
    `also_unproven(record)` of each record as read (services/coordinator/placement_trigger.py).

    One listing of the queues per pass: the replica load is counted from it once and kept up to
    date as the pass moves replicas, and a queue is read again only when its compare-and-set
    lost to a concurrent change. A queue already placed right is not written.
    """
    all_policies = list_policies(store, vhost)
    listed = list_queues(store)  # every vhost's: the load counts every replica
    load = replica_load(listed)
    after: dict[str, QueueRecord] = {}
    written: dict[str, int] = {}

    def decide(current: QueueRecord) -> QueueRecord:
        unproven = unproven_nodes
        if also_unproven is not None:
            extra = also_unproven(current)
            if extra:
                unproven = {*unproven_nodes, *extra}
        return _placed(current, all_policies, live_nodes, load, unproven)

    for queue in listed:
        if vhost and queue.vhost != vhost:
            continue
        final, wrote = _settle(store, queue, decide)
        _count_replicas(load, queue, -1)
        if final is not None:
            _count_replicas(load, final, 1)
            after[final.key] = final
            if wrote:
                written[final.key] = final.version
    return PlacementPass(after, written)


def apply_policies(store: Store, vhost: str, live_nodes: Sequence[str]) -> int:
    """`place_queues` for policy changes; returns how many queues this pass wrote."""
    return len(place_queues(store, vhost, live_nodes).written)


# What a policy change can change in a queue's record (its policy and its placement), by key.
PolicyOutcomes = Mapping[str, tuple[object, ...]]


def _policy_outcome(queue: QueueRecord) -> tuple[object, ...]:
    return (queue.policy, dict(queue.policy_definition), queue.replication, queue.master, queue.mirrors)


def policy_outcomes(store: Store) -> PolicyOutcomes:
    """Every queue's policy and placement as they stand: read before a policy change is stored, so
    that `queues_changed` counts the queues it changed, whichever pass applied it."""
    return {queue.key: _policy_outcome(queue) for queue in list_queues(store)}


def queues_changed(before: PolicyOutcomes, after: Mapping[str, QueueRecord]) -> int:
    """How many queues of `before` stand in `after` with another policy or placement (a queue
    declared or deleted in between is not counted)."""
    return sum(1 for key, queue in after.items() if key in before and before[key] != _policy_outcome(queue))


def _settle(
    store: Store, listed: QueueRecord, decide: Callable[[QueueRecord], QueueRecord]
) -> tuple[QueueRecord | None, bool]:
    """Write `decide(record)` over a queue's record by compare-and-set, starting from `listed` and
    re-reading after a conflict. Returns the record as it stands (None if deleted meanwhile) and
    whether this call wrote it (nothing is written when `decide` changes nothing)."""
    current: QueueRecord | None = listed

    def step() -> tuple[QueueRecord | None, bool] | None:
        nonlocal current
        if current is None:
            return None, False
        updated = decide(current)
        if updated == current:
            return current, False
        record = store.put(QUEUE, current.key, queue_value(updated), current.version)
        if record is not None:
            return queue_from_record(record), True
        fresh = store.get(QUEUE, current.key)
        current = queue_from_record(fresh) if fresh is not None else None
        return None

    return retry_until_set(step)


# ----------------------------------------------------------------- policies


def list_policies(store: Store, vhost: str = "") -> list[Policy]:
    found = [policy_from_record(r) for r in store.list(POLICY)]
    found = [p for p in found if not vhost or p.vhost == vhost]
    return sorted(found, key=lambda p: (p.vhost, -p.priority, p.name))


def set_policy(store: Store, policy: Policy, live_nodes: Sequence[str]) -> tuple[Policy, int]:
    """Validate and store `policy` (PolicyError if invalid), then re-apply the vhost's policies;
    returns the policy and how many queues changed."""
    before = policy_outcomes(store)
    valid = save_policy(store, policy)
    return valid, queues_changed(before, place_queues(store, valid.vhost, live_nodes).queues)


def save_policy(store: Store, policy: Policy) -> Policy:
    """Validate and store `policy` (PolicyError if invalid); applying it is the caller's next step."""
    valid = policies.validate(policy)
    key = _policy_key(valid.vhost, valid.name)
    value = {
        "vhost": valid.vhost,
        "name": valid.name,
        "pattern": valid.pattern,
        "definition": dict(valid.definition),
        "priority": valid.priority,
        "apply_to": valid.apply_to,
    }

    def step() -> Record | None:
        existing = store.get(POLICY, key)
        return store.put(POLICY, key, value, existing.version if existing else 0)

    retry_until_set(step)
    return valid


def clear_policy(store: Store, vhost: str, name: str, live_nodes: Sequence[str]) -> int:
    """Delete a policy (NotFound if absent) and re-apply the vhost's others; returns how many
    queues changed."""
    before = policy_outcomes(store)
    delete_policy(store, vhost, name)
    return queues_changed(before, place_queues(store, vhost, live_nodes).queues)


def delete_policy(store: Store, vhost: str, name: str) -> None:
    """Delete a policy (NotFound if absent); re-applying the others is the caller's next step."""
    key = _policy_key(vhost, name)

    def step() -> bool | None:
        existing = store.get(POLICY, key)
        if existing is None:
            raise NotFound(f"no policy {name!r} in vhost {vhost!r}")
        return True if store.delete(POLICY, key, existing.version) else None

    retry_until_set(step)


# ------------------------------------------------------------------- leases


def lease_from_record(record: Record | None, name: str) -> Lease | None:
    if record is None:
        return None
    v = record.value
    return Lease(name, v["holder"], v["token"], v["expires_at_ms"])


def _write_lease(store: Store, name: str, transition: Callable[[Lease | None], Lease]) -> Lease:
    def step() -> Lease | None:
        record = store.get(LEASE, name)
        lease = transition(lease_from_record(record, name))  # LeaseRefused propagates
        value = {"holder": lease.holder, "token": lease.token, "expires_at_ms": lease.expires_at_ms}
        written = store.put(LEASE, name, value, record.version if record else 0)
        return lease if written is not None else None

    return retry_until_set(step)


def acquire_lease(store: Store, name: str, holder: str, ttl_ms: int, now_ms: int) -> Lease:
    return _write_lease(store, name, lambda current: leases.acquire(current, name, holder, now_ms, ttl_ms))


def renew_lease(store: Store, name: str, holder: str, token: int, ttl_ms: int, now_ms: int) -> Lease:
    return _write_lease(store, name, lambda current: leases.renew(current, holder, token, now_ms, ttl_ms))


def release_lease(store: Store, name: str, holder: str, token: int, now_ms: int) -> Lease:
    return _write_lease(store, name, lambda current: leases.release(current, holder, token, now_ms))


def get_lease(store: Store, name: str) -> Lease:
    return lease_from_record(store.get(LEASE, name), name) or Lease(name)


def list_leases(store: Store) -> list[Lease]:
    return [lease for r in store.list(LEASE) if (lease := lease_from_record(r, r.key)) is not None]
