"""When the coordinator re-places queues, and which nodes must first prove they are alive (pure).

Responsible for: deciding, from what the coordinator's shell feeds it (queue
record changes from the store's change log, the placeable nodes and their last
heartbeats), when a placement pass (metadata.place_queues) is due, and which
nodes the pass may not give new replicas to. The shell (server.py) reads the
store and the clock, runs the passes and reports them back; nothing here does
I/O, reads a clock or starts a thread.

A pass is due when:
- the placeable nodes (alive by heartbeat, not draining) differ from those of
  the last pass: a node joined, came back, died or drains;
- a queue record changed since the last pass, other than by a pass's own
  writes: a master struck a mirror whose ring member was recorded dead, a
  mirror was promoted, a queue was declared. A node can stay alive by
  heartbeat while its ring member is recorded dead (it was paused a little
  over the ring's failure timeout, or only its link to the master was cut);
  the placeable nodes then never change, and without this the queue would run
  one replica short for good;
- a node struck from a queue has since proven itself alive (below).

Proof of life: a node that left a queue's replicas by someone else's write
(struck, or a master that lost its place) is *unproven* until the coordinator
records a heartbeat from it newer than the moment it saw the strike. An
unproven node keeps the replicas it holds but gets no new one. A node killed
with SIGKILL still looks alive by heartbeat for up to the liveness timeout
after its ring member is struck; without this rule the pass would put the
struck replica straight back on the dead node. A node that was only paused
heartbeats again within a heartbeat interval and is then picked like any
other (its queue manager recreates the replica, which rejoins and re-syncs).
Unproven nodes that are no longer placeable are forgotten: they come back
through the placeable nodes changing.

A strike that lands while a pass is reading the records may be read by that
pass before the trigger sees it (the change log delivers it a little later,
and by then the pass has reported a newer version, so it looks like nothing
new). The pass therefore takes, when it starts, the versions the trigger knows
(`PassStart.known`), and counts every node that a record it reads shows gone
since that version as unproven too (`unseen_strikes`); it reports those nodes
back (`strikes_seen_by_pass`), struck as of the pass's start. A queue the
trigger knew nothing of when the pass started has no version to compare with:
a strike in the same moment as its declaration can still be missed, and the
next change of the placeable nodes corrects that if the node is in fact dead.

Guarantees: a pass's own writes never make another pass due, since the pass
reports the version it left every queue at and older versions are nothing
new (no busy loop: after a pass, nothing is due until the nodes or the records
change); every record change seen before a pass starts is covered by that pass
or a later one; memory is bounded by the queues (one entry each) and the
nodes.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RecordChange:
    """A queue record as the change log showed it: its version and replica nodes (None: deleted)."""

    key: str
    version: int
    replicas: frozenset[str] | None
    # When the coordinator saw the change (its clock, unix ms): a strike's moment.
    seen_at_unix_ms: int


@dataclass(frozen=True)
class PassStart:
    """What a pass works with, fixed when it starts: the nodes that get no new replica, and every
    queue's newest version and replica nodes known to the trigger then, by key."""

    unproven: frozenset[str]
    known: Mapping[str, tuple[int, frozenset[str]]]

    def unseen_strikes(self, key: str, version: int, replicas: Collection[str]) -> frozenset[str]:
        """The nodes a record the pass read (`key` at `version`, on `replicas`) shows gone since the
        version the trigger knew: struck by someone else's write that the trigger has not seen yet."""
        known = self.known.get(key)
        if known is None or known[0] >= version:
            return frozenset()
        return known[1].difference(replicas)


class PlacementTrigger:
    """Decides when a placement pass is due (see the module docstring)."""

    def __init__(self) -> None:
        self._placed_on: tuple[str, ...] | None = None
        # Per queue key: the newest (version, replica nodes) known, to tell who left a queue.
        self._known: dict[str, tuple[int, frozenset[str]]] = {}
        self._pending: list[RecordChange] = []
        self._records_changed = False
        # Node -> when it was struck (unix ms); it is unproven until a newer heartbeat.
        self._struck_at_unix_ms: dict[str, int] = {}

    # ---------------------------------------------------------------- inputs

    def record_changed(self, change: RecordChange) -> None:
        """A queue record changed (from the change log, in revision order)."""
        self._pending.append(change)

    def records_missed(self) -> None:
        """The change log no longer holds changes this trigger had not seen: re-place everything."""
        self._pending.clear()
        self._known.clear()  # a missed deletion could leave a version the queue's next life never passes
        self._records_changed = True

    # ------------------------------------------------------------- decisions

    def due(self, placeable_nodes: Sequence[str], heartbeats_unix_ms: Mapping[str, int]) -> bool:
        """Whether a pass should run now, over `placeable_nodes` (sorted) with these last heartbeats."""
        self._absorb()
        if not placeable_nodes:
            return False
        if tuple(placeable_nodes) != self._placed_on or self._records_changed:
            return True
        return any(self._proven(node, heartbeats_unix_ms) for node in self._struck_at_unix_ms)

    def unproven_nodes(self, placeable_nodes: Collection[str], heartbeats_unix_ms: Mapping[str, int]) -> frozenset[str]:
        """The placeable nodes that may keep their replicas but get no new one yet."""
        return frozenset(
            node
            for node in self._struck_at_unix_ms
            if node in placeable_nodes and not self._proven(node, heartbeats_unix_ms)
        )

    # ---------------------------------------------------------------- passes

    def pass_starting(self, placeable_nodes: Collection[str], heartbeats_unix_ms: Mapping[str, int]) -> PassStart:
        """A pass over `placeable_nodes` is about to read the records: what was seen so far is covered.
        Returns what the pass works with (a copy: the pass may run on another thread)."""
        self._absorb()
        self._records_changed = False
        self._struck_at_unix_ms = {
            node: at
            for node, at in self._struck_at_unix_ms.items()
            if node in placeable_nodes and not self._proven(node, heartbeats_unix_ms)
        }
        return PassStart(frozenset(self._struck_at_unix_ms), dict(self._known))

    def strikes_seen_by_pass(self, nodes: Collection[str], pass_started_unix_ms: int) -> None:
        """A pass read records that struck `nodes` before this trigger saw them (`PassStart.unseen_strikes`):
        they are unproven until a heartbeat newer than the pass's start (a later moment than the strike,
        so never too early)."""
        for node in nodes:
            self._struck_at_unix_ms[node] = max(self._struck_at_unix_ms.get(node, 0), pass_started_unix_ms)

    def pass_finished(self, placeable_nodes: Sequence[str], queues: Mapping[str, tuple[int, frozenset[str]]]) -> None:
        """The pass placed on `placeable_nodes`; `queues` is every queue as the pass left it
        (version, replica nodes), by key: what it read, or what it wrote over it."""
        self._placed_on = tuple(placeable_nodes)
        for key, (version, replicas) in queues.items():
            known = self._known.get(key)
            if known is None or known[0] < version:
                self._known[key] = (version, replicas)

    def pass_failed(self) -> None:
        """The pass did not complete (store unavailable, conflicts): it is due again."""
        self._records_changed = True

    # --------------------------------------------------------------- helpers

    def _proven(self, node: str, heartbeats_unix_ms: Mapping[str, int]) -> bool:
        heartbeat = heartbeats_unix_ms.get(node)
        return heartbeat is not None and heartbeat > self._struck_at_unix_ms[node]

    def _absorb(self) -> None:
        """Fold the changes seen since the last decision into the state. Never during a pass: its
        own writes reach the change log before it reports them, and only its report (the versions
        it left) tells them from someone else's."""
        for change in self._pending:
            if change.replicas is None:
                self._known.pop(change.key, None)  # a deleted queue needs no placing
                continue
            known = self._known.get(change.key)
            if known is not None and known[0] >= change.version:
                continue  # a pass read this version or a newer one, or wrote it: nothing new
            self._records_changed = True
            for node in known[1] - change.replicas if known is not None else ():
                self._struck_at_unix_ms[node] = change.seen_at_unix_ms
            self._known[change.key] = (change.version, change.replicas)
        self._pending.clear()
