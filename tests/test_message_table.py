"""MessageTable (services/queue/message_table.py) against a dict doing the same: ids in runs, far
apart (a new master's epoch), removed in any order; iteration ascending; chunks freed as they empty."""

from __future__ import annotations

import random
import sys

import pytest

from services.queue.message_table import CHUNK, MessageTable
from services.queue.ops import Message

EPOCH = 1 << 40


def _message(message_id: int) -> Message:
    return Message(id=message_id, body=b"%d" % message_id)


def test_it_behaves_as_a_dict_by_id_through_random_adds_and_removals() -> None:
    rng = random.Random(13)
    table, model = MessageTable(), dict[int, Message]()
    next_ids = [1, EPOCH + 1, 2 * EPOCH + 7]
    for _ in range(20_000):
        if rng.random() < 0.7:
            run = rng.randrange(len(next_ids))
            message = _message(next_ids[run])
            next_ids[run] += rng.choice((1, 1, 1, 2, CHUNK + 3))
            assert table.add(message) is (message.id not in model)
            model.setdefault(message.id, message)
        elif model:
            ids = rng.sample(sorted(model), min(len(model), rng.randint(1, 3)))
            ids.append(rng.randrange(3 * EPOCH))  # an id that is (almost surely) not held: ignored
            removed = table.pop_many(ids)
            assert removed == [model.pop(i) for i in ids if i in model]
    assert len(table) == len(model) and bool(table) == bool(model)
    assert list(table) == sorted(model), "ids ascending"
    assert list(table.values()) == [model[i] for i in sorted(model)]
    assert table == model and model == table
    assert len(model) > 1_000, "a test of a table that holds many"
    for message_id in rng.sample(sorted(model), 100):
        assert message_id in table and table[message_id] is model[message_id]
        assert table.get(message_id) is model[message_id]
    assert 5 not in table or 5 in model
    assert table.get(3 * EPOCH + 1) is None and table.get(3 * EPOCH + 1, "none") == "none"
    assert "1" not in table  # type: ignore[comparison-overlap]


def test_adding_an_id_held_already_keeps_the_first_message() -> None:
    table = MessageTable()
    first = _message(7)
    assert table.add(first) and not table.add(_message(7))
    assert table[7] is first and len(table) == 1


def test_a_missing_id_raises_key_error() -> None:
    table = MessageTable()
    table.add(_message(1))
    with pytest.raises(KeyError):
        table[2]
    with pytest.raises(KeyError):
        table[EPOCH]


def test_a_dense_run_costs_about_ten_bytes_a_message_and_an_emptied_table_gives_it_back() -> None:
    table = MessageTable()
    count = 64 * CHUNK
    messages = [_message(EPOCH + i) for i in range(count)]
    for message in messages:
        table.add(message)
    assert sys.getsizeof(table) / count < 12, "a dict costs 42 to 52 bytes a message"
    assert table.pop_many(m.id for m in messages[: count - 1]) == messages[: count - 1]
    table.compact()
    assert list(table) == [messages[-1].id]
    assert sys.getsizeof(table) < 2_000, "only the last message's chunk is left"


def test_ids_far_apart_cost_nothing_between_them() -> None:
    table = MessageTable()
    for epoch in range(1, 6):
        table.add(_message(epoch * EPOCH))
    assert list(table) == [epoch * EPOCH for epoch in range(1, 6)]
    assert sys.getsizeof(table) < 5 * 1_000, "a chunk for each, nothing for the ids between"
