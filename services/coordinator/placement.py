"""Replica placement: on which nodes a queue's master and mirrors belong (pure).

Responsible for: turning a queue's effective policy definition (ha-mode,
ha-params), the live nodes and the queue's current placement into the
placement it should have, and into the mirrors to start and stop
(`changes`). The caller (the coordinator) reads the inputs, stores the result
and tells the queue layer; this module does no I/O, reads no clock and draws no
random numbers, so equal inputs always give equal placements.

Rules (RabbitMQ classic mirrored queues, ARCHITECTURE.md section 3):

- Replica count by ha-mode: no definition or no ha-mode: the master alone;
  `all`: every live node; `exactly N`: N replicas in total (master + N - 1
  mirrors), capped at the number of live nodes; `nodes [list]`: the listed nodes
  that are live. If none of the listed nodes is live, the live replicas the
  queue already has are kept as they are (nothing added), or, for a queue with
  no live replica, the master alone is placed as for a new queue.
- The master never moves while it is live: a policy change does not move it,
  even when `ha-mode nodes` does not list its node (the listed live nodes then
  become its mirrors), exactly as RabbitMQ keeps the master when no mirror is
  synchronised.
- Master lost: `place` does not elect anybody. If the current master is not
  live, the new master is the FIRST LIVE MIRROR OF `current.mirrors` (join
  order, so the eldest). The queue layer promotes the eldest *synchronised*
  mirror (or, with ha-promote-on-failure always, the eldest one) and passes
  the outcome back as `current`, with the promoted node as master; `place`
  is then consistent with it because it never moves a live master.
- Mirrors keep their join order. Live current mirrors that still qualify are
  kept, oldest first; new mirrors are appended after them, least loaded first
  (`load[node]`: replicas already on that node, 0 when absent; ties by node
  name). When the count shrinks, the most recently added mirrors go first.
- The master of a queue without a live replica (new queue, or every replica
  lost) is `preferred_master` when it is live and eligible (for `ha-mode
  nodes` the eligible nodes are the listed live ones, if any), otherwise the
  first eligible node in placement order: least loaded, then by name. So the
  order of `live_nodes` never matters.

Guarantees: the master is live, mirrors are live and distinct and never hold the
master; no live node means `NoLiveNodes`. `definition` is assumed validated
(`policies.validate`); a malformed ha-mode or ha-params raises ValueError.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one queue lives: its master node and its mirror nodes in join order (eldest first)."""

    master: str
    mirrors: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "mirrors", tuple(self.mirrors))
        if not self.master:
            raise ValueError("a placement needs a master node")
        if self.master in self.mirrors:
            raise ValueError(f"the master {self.master!r} cannot also be a mirror")
        if len(set(self.mirrors)) != len(self.mirrors):
            raise ValueError(f"mirrors must be distinct, got {self.mirrors!r}")

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every replica's node, the master first."""
        return (self.master, *self.mirrors)


class NoLiveNodes(Exception):
    """There is no live node to place a queue on."""


def place(
    definition: Mapping[str, Any] | None,
    live_nodes: Sequence[str],
    current: Placement | None,
    *,
    preferred_master: str | None = None,
    load: Mapping[str, int] | None = None,
) -> Placement:
    """The placement a queue should have now (see the module docstring for the rules)."""
    live = frozenset(live_nodes)
    if not live:
        raise NoLiveNodes("no live node to place the queue on")
    loads: Mapping[str, int] = load if load is not None else {}

    def by_load(nodes: Iterable[str]) -> list[str]:
        return sorted(nodes, key=lambda node: (loads.get(node, 0), node))

    mode, replica_count, listed = _ha_settings(definition)
    listed_live = [node for node in listed if node in live]

    # 1. The master: kept if live, else the eldest live mirror, else chosen afresh.
    survivors = [node for node in current.nodes if node in live] if current is not None else []
    if survivors:
        master, kept = survivors[0], survivors[1:]
    else:
        eligible = listed_live or sorted(live)
        if preferred_master is not None and preferred_master in eligible:
            master = preferred_master
        else:
            master = by_load(eligible)[0]
        kept = []

    # 2. The mirrors: keep those that still qualify (oldest first), then top up.
    if mode is None:
        return Placement(master, ())
    if mode == "all":
        wanted = live - {master}
        kept = [node for node in kept if node in wanted]
        return Placement(master, (*kept, *by_load(wanted.difference(kept))))
    if mode == "exactly":
        mirror_count = min(replica_count, len(live)) - 1
        kept = kept[:mirror_count]  # shrinking drops the newest mirrors
        candidates = by_load(live - {master, *kept})
        return Placement(master, (*kept, *candidates[: mirror_count - len(kept)]))
    # mode == "nodes"
    if not listed_live:
        return Placement(master, tuple(kept))  # nothing listed is live: keep what lives
    wanted = frozenset(listed_live) - {master}
    kept = [node for node in kept if node in wanted]
    return Placement(master, (*kept, *by_load(wanted.difference(kept))))


def changes(old: Placement, new: Placement) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(mirrors to add, mirrors to remove) to go from `old` to `new`.

    To add: the mirrors of `new` that were not mirrors of `old`, in `new`'s join
    order. To remove: the mirrors of `old` that are neither mirrors nor the
    master of `new`, in `old`'s join order (a mirror promoted to master is not
    removed; a lost master is not a mirror and is not listed).
    """
    added = tuple(node for node in new.mirrors if node not in old.mirrors)
    removed = tuple(node for node in old.mirrors if node not in new.mirrors and node != new.master)
    return added, removed


def _ha_settings(definition: Mapping[str, Any] | None) -> tuple[str | None, int, tuple[str, ...]]:
    """(ha-mode or None, N of exactly (else 0), the distinct listed nodes of nodes (else empty))."""
    if definition is None or "ha-mode" not in definition:
        return None, 0, ()
    mode = definition["ha-mode"]
    params = definition.get("ha-params")
    if mode == "all":
        return "all", 0, ()
    if mode == "exactly":
        if not isinstance(params, int) or isinstance(params, bool) or params < 1:
            raise ValueError(f"ha-mode exactly needs a positive integer ha-params, got {params!r}")
        return "exactly", params, ()
    if mode == "nodes":
        if not isinstance(params, list | tuple) or not params or not all(isinstance(node, str) for node in params):
            raise ValueError(f"ha-mode nodes needs a non-empty list of node names, got {params!r}")
        return "nodes", 0, tuple(dict.fromkeys(params))
    raise ValueError(f"unknown ha-mode {mode!r}")
