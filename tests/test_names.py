"""The one rule for names (ringq.names), and the places that apply it: the coordinator's records and
policies, and the directory a node keeps a queue's files in (a digest, never the name)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringq.names import MAX_NAME_BYTES, InvalidName, check_name, name_problem
from services.coordinator import metadata, policies
from services.coordinator.metadata import QueueRecord
from services.coordinator.sqlite_store import SqliteStore
from services.queue.manager import queue_dir_name

ACCEPTED = ["/", "orders", "..", ".", "../../etc", "a/b", "with space", "ünïcödé", "😀", "x" * MAX_NAME_BYTES]
REFUSED = [
    ("", "must not be empty"),
    ("x" * (MAX_NAME_BYTES + 1), "at most 255 bytes of UTF-8, got 256"),
    ("é" * 128, "at most 255 bytes of UTF-8, got 256"),
    ("a\nb", "control character"),
    ("nul\x00", "control character"),
    ("\x1b[31m", "control character"),
    ("a\u202eb", "format character"),  # right-to-left override: a name that displays as another
    ("a\u2028b", "line separator"),
    ("\ud800", "surrogate"),
    ("\U000e0001x", "format character"),
]


@pytest.mark.parametrize("name", ACCEPTED)
def test_accepted_names(name: str) -> None:
    assert name_problem(name) is None
    assert check_name("queue", name) == name


@pytest.mark.parametrize(("name", "why"), REFUSED)
def test_refused_names_say_why(name: str, why: str) -> None:
    problem = name_problem(name)
    assert problem is not None and why in problem
    with pytest.raises(InvalidName, match=f"^queue {problem[:20]}"):
        check_name("queue", name)


def test_a_name_that_is_not_a_string_is_refused() -> None:
    assert name_problem(7) == "must be a string, got int"


@pytest.mark.parametrize("name", ["..", "../../etc", "a/b", "x" * MAX_NAME_BYTES, "😀" * 63])
def test_a_queue_directory_is_a_digest_never_the_name(name: str) -> None:
    for record in (QueueRecord("/", name, gm_group="queue.1"), QueueRecord(name, "q", gm_group=name)):
        directory = queue_dir_name(record)
        assert directory.startswith("q-") and len(directory) == 34
        assert all(c in "0123456789abcdef" for c in directory[2:])


def test_each_incarnation_and_each_vhost_gets_its_own_directory() -> None:
    names = {
        queue_dir_name(QueueRecord("/", "a", gm_group="g1")),
        queue_dir_name(QueueRecord("/", "a", gm_group="g2")),
        queue_dir_name(QueueRecord("v", "a", gm_group="g1")),
        queue_dir_name(QueueRecord("/", "a/g1", gm_group="")),  # no ambiguity from joining with "/"
        queue_dir_name(QueueRecord("/a", "g1", gm_group="")),
    }
    assert len(names) == 5


@pytest.mark.parametrize(
    ("record", "why"),
    [
        (QueueRecord("/", "bad\nname"), "name must not contain a control character"),
        (QueueRecord("v\x00", "q"), "vhost must not contain a control character"),
        (QueueRecord("/", "x" * 256), "name must be at most 255 bytes"),
    ],
)
def test_the_coordinator_refuses_a_queue_whose_name_breaks_the_rule(
    record: QueueRecord, why: str, tmp_path: Path
) -> None:
    store = SqliteStore(str(tmp_path / "store.db"))
    try:
        with pytest.raises(InvalidName, match=why):
            metadata.declare_queue(store, record, ["node1"])
        good = metadata.declare_queue(store, QueueRecord("/", "good"), ["node1"])
        with pytest.raises(InvalidName, match="gm_group must not contain a control character"):
            metadata.update_queue(store, QueueRecord("/", "good", gm_group="x\n"), good.version)
        with pytest.raises(ValueError, match="gm_group must not be empty"):
            metadata.update_queue(store, QueueRecord("/", "good"), good.version)
    finally:
        store.close()


def test_a_name_of_255_multibyte_bytes_fits_the_store(tmp_path: Path) -> None:
    store = SqliteStore(str(tmp_path / "store.db"))
    try:
        name = "é" * 127  # 254 bytes, each percent-quoted to 6 characters in the store key
        declared = metadata.declare_queue(store, QueueRecord("é" * 127, name), ["node1"])
        assert metadata.get_queue(store, declared.vhost, declared.name).name == name
    finally:
        store.close()


def test_policy_names_follow_the_same_rule() -> None:
    with pytest.raises(policies.PolicyError, match="name: must not contain a control character"):
        policies.validate(policies.Policy(vhost="/", name="p\n", pattern=".*", definition={}))
