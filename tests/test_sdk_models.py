"""The SDK's typed surface, without a cluster: the blocking and asyncio APIs take explicit keyword arguments
(no **options) and return ringq.models dataclasses built from the wire's messages (JSON texts decoded,
absent optional figures None), and the package says it is typed (py.typed)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import typing
from pathlib import Path

import pytest

import ringq
from ringq import aio, blocking, models
from ringq.v1 import access_pb2, cluster_pb2, queue_pb2

PUBLIC_CLASSES = [
    blocking.Connection,
    blocking.Producer,
    blocking.Consumer,
    blocking.Admin,
    aio.Connection,
    aio.Producer,
    aio.Consumer,
    aio.Admin,
]


@pytest.mark.parametrize("cls", PUBLIC_CLASSES, ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_public_methods_take_explicit_typed_arguments(cls: type) -> None:
    for name, method in inspect.getmembers(cls, inspect.isfunction):
        if name.startswith("_") and name != "__init__":
            continue
        signature = inspect.signature(method)
        kinds = {p.kind for p in signature.parameters.values()}
        assert inspect.Parameter.VAR_KEYWORD not in kinds, f"{cls.__name__}.{name} takes **options"
        hints = typing.get_type_hints(method)
        untyped = [p for p in signature.parameters if p != "self" and p not in hints]
        assert not untyped, f"{cls.__name__}.{name}: {untyped} have no type"
        assert "return" in hints, f"{cls.__name__}.{name} has no return type"


def test_blocking_and_asyncio_return_the_same_dataclasses() -> None:
    pairs = [
        ("declare_queue", blocking.Connection, aio.Connection, models.QueueStatus),
        ("queue_status", blocking.Connection, aio.Connection, models.QueueStatus),
        ("cluster_status", blocking.Admin, aio.Admin, models.ClusterStatus),
        ("list_policies", blocking.Admin, aio.Admin, list[models.Policy]),
        ("list_queues", blocking.Admin, aio.Admin, list[models.QueueRecord]),
        ("forget_node", blocking.Admin, aio.Admin, list[models.QueueRecord]),
        ("list_users", blocking.Admin, aio.Admin, list[models.User]),
        ("list_permissions", blocking.Admin, aio.Admin, list[models.Permission]),
    ]
    for name, sync, asynchronous, result in pairs:
        assert typing.get_type_hints(getattr(sync, name))["return"] == result, name
        assert typing.get_type_hints(getattr(asynchronous, name))["return"] == result, name


def test_queue_status_from_the_wire() -> None:
    info = queue_pb2.QueueInfo(
        queue=queue_pb2.QueueRef(vhost="v", queue="orders"),
        master_node="node1",
        master_address="127.0.0.1:7101",
        mirrors=["node2", "node3"],
        synchronised_mirrors=["node2"],
        depth=5,
        ready=3,
        unacked=2,
        consumers=1,
        policy="ha",
        status="running",
        events=[queue_pb2.QueueEvent(time_unix_ms=7, kind="promoted", node="node1", detail="it was")],
    )
    status = models.QueueStatus.from_proto(info)
    assert status == models.QueueStatus(
        name="orders",
        vhost="v",
        depth=5,
        ready=3,
        unacked=2,
        consumers=1,
        master_node="node1",
        master_address="127.0.0.1:7101",
        mirrors=("node2", "node3"),
        synchronised_mirrors=("node2",),
        status="running",
        policy="ha",
        events=(models.QueueEvent(7, "promoted", "node1", "it was"),),
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        status.depth = 0  # type: ignore[misc]


def test_cluster_status_policies_records_and_access_from_the_wire() -> None:
    response = cluster_pb2.ClusterStatusResponse(
        nodes=[
            cluster_pb2.NodeRecord(node="node1", address="a:1", alive=True, disk_free_bytes=10, disk_alarm=True),
            cluster_pb2.NodeRecord(node="node2", address="a:2"),
        ],
        coordinators=[cluster_pb2.CoordinatorEndpoint(address="a:0", alive=True)],
        store_kind="sqlite",
    )
    status = models.ClusterStatus.from_proto(response)
    assert status.node("node1").disk_free_bytes == 10 and status.node("node1").disk_alarm
    two = status.node("node2")
    assert (two.alive, two.disk_free_bytes, two.memory_used_bytes, two.disk_alarm) == (False, None, None, False)
    assert status.coordinators == (models.CoordinatorStatus("a:0", True),) and status.store_kind == "sqlite"
    with pytest.raises(KeyError):
        status.node("node9")
    policy = models.Policy.from_proto(
        cluster_pb2.Policy(name="ha", pattern="^ha\\.", definition_json=json.dumps({"ha-mode": "all"}), priority=2)
    )
    assert (policy.definition, policy.priority, policy.apply_to) == ({"ha-mode": "all"}, 2, "")
    record = models.QueueRecord.from_proto(
        cluster_pb2.QueueRecord(
            vhost="/",
            name="q",
            arguments={"x-max-length": "10"},
            master="node1",
            mirrors=["node2"],
            replication=cluster_pb2.REPLICATION_LEVEL_WIRING,
            policy_definition_json='{"ha-mode": "exactly", "ha-params": 2}',
        )
    )
    assert (record.arguments, record.replication, record.mirrors) == ({"x-max-length": 10}, "wiring", ("node2",))
    assert record.policy_definition == {"ha-mode": "exactly", "ha-params": 2}
    assert models.User.from_proto(access_pb2.UserInfo(name="bob", tags=["monitoring"])) == models.User(
        "bob", ("monitoring",)
    )
    permission = access_pb2.Permission(user="bob", vhost="/", configure="", write="^b", read=".*")
    assert models.Permission.from_proto(permission) == models.Permission("bob", "/", "", "^b", ".*")


def test_the_package_is_typed() -> None:
    assert (Path(ringq.__file__).parent / "py.typed").is_file()
