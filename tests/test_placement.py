"""Unit tests of the pure replica placement rules (services.coordinator.placement)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from services.coordinator.placement import NoLiveNodes, Placement, changes, place

NODES = ("n1", "n2", "n3", "n4", "n5")
ALL: dict[str, Any] = {"ha-mode": "all"}


def exactly(count: int) -> dict[str, Any]:
    return {"ha-mode": "exactly", "ha-params": count, "ha-sync-mode": "automatic"}


def nodes(*names: str) -> dict[str, Any]:
    return {"ha-mode": "nodes", "ha-params": list(names)}


# -- replica counts by ha-mode for a new queue ---------------------------------


@pytest.mark.parametrize(
    ("definition", "live", "expected"),
    [
        (None, NODES, Placement("n1", ())),
        ({"max-length": 10}, NODES, Placement("n1", ())),  # a policy without ha-mode
        (ALL, NODES, Placement("n1", ("n2", "n3", "n4", "n5"))),
        (ALL, ("n3",), Placement("n3", ())),
        (exactly(1), NODES, Placement("n1", ())),
        (exactly(2), NODES, Placement("n1", ("n2",))),
        (exactly(3), NODES, Placement("n1", ("n2", "n3"))),
        (exactly(5), ("n1", "n2", "n3"), Placement("n1", ("n2", "n3"))),  # capped at the live nodes
        (exactly(9), ("n4",), Placement("n4", ())),
        (nodes("n2", "n4"), NODES, Placement("n2", ("n4",))),
        (nodes("n4", "n2", "n9"), NODES, Placement("n2", ("n4",))),  # n9 is not live
        (nodes("n9"), NODES, Placement("n1", ())),  # nothing listed is live: master alone
    ],
)
def test_new_queue(definition: dict[str, Any] | None, live: tuple[str, ...], expected: Placement) -> None:
    assert place(definition, live, None) == expected


@pytest.mark.parametrize("definition", [None, ALL, exactly(2), exactly(3), nodes("n2", "n3", "n5")])
def test_the_order_of_live_nodes_does_not_matter(definition: dict[str, Any] | None) -> None:
    placements = {place(definition, order, None) for order in itertools.permutations(NODES[:4])}
    placements |= {place(definition, (*NODES[:4], "n2"), None)}  # nor do repeats
    assert len(placements) == 1


def test_preferred_master_is_used_when_live_and_eligible() -> None:
    assert place(exactly(2), NODES, None, preferred_master="n3") == Placement("n3", ("n1",))
    assert place(None, NODES, None, preferred_master="n5") == Placement("n5", ())
    # not live: ignored
    assert place(exactly(2), ("n1", "n2"), None, preferred_master="n3") == Placement("n1", ("n2",))
    # ha-mode nodes: only a listed live node can be the master of a new queue
    assert place(nodes("n2", "n4"), NODES, None, preferred_master="n4") == Placement("n4", ("n2",))
    assert place(nodes("n2", "n4"), NODES, None, preferred_master="n1") == Placement("n2", ("n4",))
    # nothing listed is live: the preferred node, or the first live node
    assert place(nodes("n9"), NODES, None, preferred_master="n3") == Placement("n3", ())
    assert place(nodes("n9"), ("n4", "n2"), None) == Placement("n2", ())


# -- least-loaded choice -------------------------------------------------------


def test_new_mirrors_go_to_the_least_loaded_nodes() -> None:
    load = {"n1": 0, "n2": 7, "n3": 2, "n4": 2, "n5": 1}
    assert place(exactly(3), NODES, None, preferred_master="n1", load=load) == Placement("n1", ("n5", "n3"))
    # ties by node name; a node missing from load has load 0
    assert place(exactly(4), NODES, None, preferred_master="n1", load={"n2": 3, "n5": 3}) == Placement(
        "n1", ("n3", "n4", "n2")
    )
    # ha-mode all appends every node, least loaded first
    assert place(ALL, NODES, None, preferred_master="n1", load=load) == Placement("n1", ("n5", "n3", "n4", "n2"))


def test_a_new_master_without_preference_goes_to_the_least_loaded_node() -> None:
    assert place(None, NODES, None, load={"n1": 4, "n2": 4, "n3": 1, "n4": 1, "n5": 9}) == Placement("n3", ())


def test_kept_mirrors_stay_ahead_of_less_loaded_newcomers() -> None:
    current = Placement("n1", ("n4",))
    assert place(exactly(3), NODES, current, load={"n4": 100}) == Placement("n1", ("n4", "n2"))


# -- stability -----------------------------------------------------------------


def test_a_policy_change_never_moves_a_live_master() -> None:
    current = Placement("n3", ("n1",))
    assert place(None, NODES, current) == Placement("n3", ())
    assert place(exactly(2), NODES, current, preferred_master="n5") == Placement("n3", ("n1",))
    assert place(ALL, NODES, current, load={"n3": 50}) == Placement("n3", ("n1", "n2", "n4", "n5"))
    # not listed: the master stays, the listed live nodes become its mirrors
    assert place(nodes("n4", "n5"), NODES, current) == Placement("n3", ("n4", "n5"))


def test_existing_mirrors_keep_their_join_order() -> None:
    current = Placement("n1", ("n5", "n3"))
    assert place(exactly(3), NODES, current) == current
    assert place(exactly(4), NODES, current) == Placement("n1", ("n5", "n3", "n2"))
    assert place(ALL, NODES, current) == Placement("n1", ("n5", "n3", "n2", "n4"))
    assert place(nodes("n2", "n3", "n5"), NODES, current) == Placement("n1", ("n5", "n3", "n2"))


def test_a_lost_mirror_is_replaced() -> None:
    current = Placement("n1", ("n2", "n3"))
    live = ("n1", "n2", "n4", "n5")
    assert place(exactly(3), live, current) == Placement("n1", ("n2", "n4"))
    assert place(ALL, live, current) == Placement("n1", ("n2", "n4", "n5"))


def test_a_mirror_of_nodes_mode_is_not_replaced_by_an_unlisted_node() -> None:
    current = Placement("n1", ("n2", "n3"))
    assert place(nodes("n1", "n2", "n3"), ("n1", "n2", "n4"), current) == Placement("n1", ("n2",))


def test_a_placement_that_already_fits_is_returned_unchanged() -> None:
    for definition, current in [
        (None, Placement("n2")),
        (ALL, Placement("n2", ("n4", "n1", "n5", "n3"))),
        (exactly(3), Placement("n2", ("n5", "n1"))),
        (nodes("n1", "n2", "n5"), Placement("n2", ("n5", "n1"))),
    ]:
        assert place(definition, NODES, current, preferred_master="n3", load={"n2": 9}) == current


# -- shrinking -----------------------------------------------------------------


def test_shrinking_drops_the_newest_mirrors_first() -> None:
    current = Placement("n1", ("n4", "n2", "n5"))
    assert place(exactly(3), NODES, current) == Placement("n1", ("n4", "n2"))
    assert place(exactly(2), NODES, current) == Placement("n1", ("n4",))
    assert place(exactly(1), NODES, current) == Placement("n1", ())
    assert place(None, NODES, current) == Placement("n1", ())


def test_changing_the_node_list_drops_unlisted_mirrors() -> None:
    current = Placement("n1", ("n2", "n3", "n4"))
    new = place(nodes("n1", "n3", "n5"), NODES, current)
    assert new == Placement("n1", ("n3", "n5"))
    assert changes(current, new) == (("n5",), ("n2", "n4"))


def test_nodes_mode_with_nothing_listed_live_keeps_the_live_replicas() -> None:
    current = Placement("n1", ("n2", "n3"))
    assert place(nodes("n8", "n9"), ("n1", "n2", "n3", "n4"), current) == current
    assert place(nodes("n8", "n9"), ("n2", "n3", "n4"), current) == Placement("n2", ("n3",))


# -- master loss ---------------------------------------------------------------


def test_master_loss_gives_the_eldest_live_mirror() -> None:
    current = Placement("n1", ("n3", "n2", "n4"))
    live = ("n2", "n3", "n4", "n5")
    assert place(ALL, live, current) == Placement("n3", ("n2", "n4", "n5"))
    assert place(exactly(3), live, current) == Placement("n3", ("n2", "n4"))
    # the eldest mirror is lost too: the next eldest live one
    assert place(exactly(3), ("n2", "n4", "n5"), current) == Placement("n2", ("n4", "n5"))
    # preferences and loads do not override the rule
    assert place(exactly(2), live, current, preferred_master="n5", load={"n3": 99}) == Placement("n3", ("n2",))


def test_master_loss_in_nodes_mode_keeps_the_promoted_master_even_if_unlisted() -> None:
    current = Placement("n1", ("n2", "n3"))
    assert place(nodes("n1", "n3", "n4"), ("n2", "n3", "n4"), current) == Placement("n2", ("n3", "n4"))


def test_master_loss_without_mirrors_on_a_new_node() -> None:
    # every replica lost: placed like a new queue (the caller decides whether that is acceptable)
    assert place(exactly(2), ("n4", "n5"), Placement("n1", ("n2",))) == Placement("n4", ("n5",))
    assert place(None, ("n4", "n5"), Placement("n1"), preferred_master="n5") == Placement("n5", ())


def test_the_queue_layer_passes_back_the_synchronised_mirror_it_promoted() -> None:
    # place proposes the eldest live mirror n2; the queue layer promoted n3, the
    # eldest *synchronised* one, and passes that back: place keeps it.
    before = Placement("n1", ("n2", "n3"))
    assert place(exactly(3), ("n2", "n3", "n4"), before).master == "n2"
    promoted = Placement("n3", ("n2",))
    assert place(exactly(3), ("n2", "n3", "n4"), promoted) == Placement("n3", ("n2", "n4"))


# -- no live nodes -------------------------------------------------------------


@pytest.mark.parametrize("definition", [None, ALL, exactly(2), nodes("n1")])
@pytest.mark.parametrize("current", [None, Placement("n1", ("n2",))])
def test_no_live_nodes(definition: dict[str, Any] | None, current: Placement | None) -> None:
    with pytest.raises(NoLiveNodes):
        place(definition, (), current)


# -- policy change sequences and changes() --------------------------------------


def test_exactly_two_then_all_then_exactly_two() -> None:
    live = ("n1", "n2", "n3", "n4")
    first = place(exactly(2), live, None, preferred_master="n2")
    assert first == Placement("n2", ("n1",))

    second = place(ALL, live, first, load={"n3": 5})
    assert second == Placement("n2", ("n1", "n4", "n3"))
    assert changes(first, second) == (("n4", "n3"), ())

    third = place(exactly(2), live, second)
    assert third == Placement("n2", ("n1",))
    assert changes(second, third) == ((), ("n4", "n3"))

    # and back to all: the same nodes return, the eldest mirror still first
    fourth = place(ALL, live, third)
    assert fourth == Placement("n2", ("n1", "n3", "n4"))
    assert changes(third, fourth) == (("n3", "n4"), ())


def test_exactly_three_then_nodes_then_none() -> None:
    first = place(exactly(3), NODES, None)
    assert first == Placement("n1", ("n2", "n3"))
    second = place(nodes("n3", "n4"), NODES, first)
    assert second == Placement("n1", ("n3", "n4"))
    assert changes(first, second) == (("n4",), ("n2",))
    third = place(None, NODES, second)
    assert changes(second, third) == ((), ("n3", "n4"))


def test_changes_on_master_loss() -> None:
    old = Placement("n1", ("n2", "n3"))
    new = place(exactly(3), ("n2", "n3", "n4"), old)
    assert new == Placement("n2", ("n3", "n4"))
    # the promoted mirror is not removed, the lost master is not a mirror
    assert changes(old, new) == (("n4",), ())


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (Placement("n1"), Placement("n1"), ((), ())),
        (Placement("n1", ("n2",)), Placement("n1", ("n2",)), ((), ())),
        (Placement("n1"), Placement("n1", ("n2", "n3")), (("n2", "n3"), ())),
        (Placement("n1", ("n2", "n3")), Placement("n1"), ((), ("n2", "n3"))),
        (Placement("n1", ("n2", "n3")), Placement("n1", ("n3", "n4")), (("n4",), ("n2",))),
        (Placement("n1", ("n2",)), Placement("n2"), ((), ())),
    ],
)
def test_changes(old: Placement, new: Placement, expected: tuple[tuple[str, ...], tuple[str, ...]]) -> None:
    assert changes(old, new) == expected


# -- Placement values and malformed input -------------------------------------


def test_placement_invariants() -> None:
    assert Placement("n1", ["n2", "n3"]).mirrors == ("n2", "n3")  # type: ignore[arg-type]
    assert Placement("n1", ("n2",)).nodes == ("n1", "n2")
    with pytest.raises(ValueError, match="cannot also be a mirror"):
        Placement("n1", ("n2", "n1"))
    with pytest.raises(ValueError, match="distinct"):
        Placement("n1", ("n2", "n2"))
    with pytest.raises(ValueError, match="needs a master"):
        Placement("", ())


@pytest.mark.parametrize(
    "definition",
    [
        {"ha-mode": "some"},
        {"ha-mode": "exactly"},
        {"ha-mode": "exactly", "ha-params": 0},
        {"ha-mode": "exactly", "ha-params": True},
        {"ha-mode": "nodes", "ha-params": []},
        {"ha-mode": "nodes", "ha-params": "n1"},
    ],
)
def test_malformed_definitions_are_refused(definition: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        place(definition, NODES, None)


# -- invariants over many inputs -------------------------------------------------

DEFINITIONS: list[dict[str, Any] | None] = [
    None,
    ALL,
    exactly(1),
    exactly(2),
    exactly(3),
    exactly(9),
    nodes("n1", "n3"),
    nodes("n4"),
    nodes("n9"),
]
CURRENTS: list[Placement | None] = [
    None,
    Placement("n1"),
    Placement("n1", ("n2", "n3")),
    Placement("n4", ("n3", "n1")),
    Placement("n2", ("n4",)),
]
LIVE_SETS = [subset for size in range(1, 5) for subset in itertools.combinations(NODES[:4], size)]


def test_invariants_hold_for_every_small_input() -> None:
    for definition, current, live in itertools.product(DEFINITIONS, CURRENTS, LIVE_SETS):
        placed = place(definition, live, current, load={"n2": 1})
        context = (definition, current, live)
        assert placed.master in live, context
        assert set(placed.mirrors) <= set(live), context
        assert place(definition, live, current, load={"n2": 1}) == placed, context  # deterministic
        assert place(definition, live, placed, load={"n2": 1}) == placed, context  # a fixed point
        if current is not None and current.master in live:
            assert placed.master == current.master, context
        elif current is not None and any(node in live for node in current.mirrors):
            assert placed.master == next(node for node in current.mirrors if node in live), context
        # kept mirrors keep their relative order and come first
        survivors = [node for node in (current.mirrors if current else ()) if node in placed.mirrors]
        assert list(placed.mirrors[: len(survivors)]) == survivors, context
        if definition is None:
            assert placed.mirrors == (), context
        elif definition["ha-mode"] == "all":
            assert set(placed.nodes) == set(live), context
        elif definition["ha-mode"] == "exactly":
            assert len(placed.nodes) == min(definition["ha-params"], len(live)), context
