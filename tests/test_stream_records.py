"""An ordered stream's record in the coordinator's store (services/coordinator/stream_records.py), over the
in-memory store tests use for the coordinator: declare, pick, change by compare-and-set, delete."""

from __future__ import annotations

import threading

import pytest

from services.coordinator import stream_records
from services.coordinator.metadata import NotFound, QueueMismatch
from tests.memory_store import MemoryStore


def test_a_declared_stream_has_its_groups_and_a_second_declaration_must_match() -> None:
    store = MemoryStore()
    stream = stream_records.declare_stream(store, "/", "orders", 3, durable=True)
    assert stream.groups == ("stream/orders/1", "stream/orders/2", "stream/orders/3")
    assert stream.lists.send == stream.groups and stream.lists.consume == ()
    assert stream_records.declare_stream(store, "/", "orders", 3, durable=True) == stream
    with pytest.raises(QueueMismatch, match="exists with 3 groups"):
        stream_records.declare_stream(store, "/", "orders", 2, durable=True)
    with pytest.raises(ValueError, match="groups must be 2 to 64, got 1"):
        stream_records.declare_stream(store, "/", "solo", 1, durable=True)
    assert [s.name for s in stream_records.list_streams(store)] == ["orders"]


def test_a_pick_is_stored_before_it_is_returned_and_changes_survive_a_reread() -> None:
    store = MemoryStore()
    stream_records.declare_stream(store, "/", "orders", 2, durable=False)
    record, group = stream_records.pick(store, "/", "orders")
    assert group == "stream/orders/1"
    stored = stream_records.get_stream(store, "/", "orders")
    assert stored.lists.consume == ("stream/orders/1",) and stored == record
    record = stream_records.change_lists(store, "/", "orders", lambda lists: lists.replica_lost(group))
    assert record.lists.send == ("stream/orders/2",)
    assert stream_records.get_stream(store, "/", "orders").lists.down == frozenset({group})


def test_concurrent_picks_append_the_group_once() -> None:
    store = MemoryStore()
    stream_records.declare_stream(store, "/", "orders", 2, durable=False)
    picked: list[str | None] = []

    def picker() -> None:
        picked.append(stream_records.pick(store, "/", "orders")[1])

    threads = [threading.Thread(target=picker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert set(picked) == {"stream/orders/1"}
    assert stream_records.get_stream(store, "/", "orders").lists.consume == ("stream/orders/1",)


def test_an_unknown_stream_is_not_found_and_a_deleted_one_is_gone() -> None:
    store = MemoryStore()
    with pytest.raises(NotFound):
        stream_records.pick(store, "/", "nope")
    stream_records.declare_stream(store, "v", "orders", 2, durable=False)
    assert stream_records.delete_stream(store, "v", "orders").name == "orders"
    with pytest.raises(NotFound):
        stream_records.get_stream(store, "v", "orders")
