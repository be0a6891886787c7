"""Unit tests of users, vhosts and permissions: the pure table, the records, passwords, credentials."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.access import AccessTable, Operation, Permission, User, tags_problem
from services.access_guard import Principal, _basic_credentials, _from_loopback, scoped_publisher
from services.coordinator import access_records
from services.coordinator.metadata import NotFound, QueueRecord, declare_queue
from services.coordinator.policies import pattern_problem
from services.coordinator.sqlite_store import SqliteStore
from services.passwords import PasswordChecks, hash_password, matches, password_problem
from services.request_guard import Refused

TABLE = AccessTable.of(
    [User("guest", "h", frozenset({"administrator"})), User("alice", "h"), User("bob", "h", frozenset({"monitoring"}))],
    ["/", "v1"],
    [
        Permission("alice", "/", "^alice\\.", "^alice\\.|^shared$", "^alice\\."),
        Permission("guest", "/", ".*", ".*", ".*"),
    ],
)


def test_permissions_are_searched_per_operation_and_vhost() -> None:
    assert TABLE.permission_problem("alice", "/", Operation.CONFIGURE, "alice.q") is None
    assert TABLE.permission_problem("alice", "/", Operation.WRITE, "shared") is None
    problem = TABLE.permission_problem("alice", "/", Operation.READ, "shared")
    assert problem is not None and "may not read 'shared'" in problem
    assert "no permissions in vhost 'v1'" in (TABLE.permission_problem("alice", "v1", Operation.READ, "alice.q") or "")
    assert "no vhost 'v9'" in (TABLE.permission_problem("guest", "v9", Operation.READ, "q") or "")
    empty = AccessTable.of([User("carol", "h")], ["/"], [Permission("carol", "/", "", "", "")])
    assert empty.permission_problem("carol", "/", Operation.READ, "") is not None, "'' matches nothing"


def test_tags_and_logins() -> None:
    assert TABLE.tag_problem("bob", frozenset({"monitoring", "administrator"}), "look") is None
    assert "needs the tag administrator" in (TABLE.tag_problem("bob", frozenset({"administrator"}), "add users") or "")
    assert TABLE.login_problem("guest", loopback=True) is None
    assert "only from loopback" in (TABLE.login_problem("guest", loopback=False) or "")
    assert TABLE.login_problem("nobody", loopback=True) == "unknown user or wrong password"
    assert tags_problem(["administrator", "root"]) is not None and tags_problem(["monitoring"]) is None
    assert pattern_problem("(a+)+$") is None and pattern_problem("(") is not None
    assert pattern_problem("a" * 5000) is not None


def test_peers_and_credentials() -> None:
    assert _from_loopback("ipv4:127.0.0.1:5000") and _from_loopback("ipv6:[::1]:5000")
    assert _from_loopback("ipv6:[::ffff:127.0.0.1]:5000") and _from_loopback("unix:/tmp/s")
    assert not _from_loopback("ipv4:10.0.0.2:5000") and not _from_loopback("ipv6:[fe80::1]:5000")

    class Context:
        def __init__(self, metadata: list[tuple[str, str]]) -> None:
            self.metadata = metadata

        def invocation_metadata(self) -> Any:
            return self.metadata

    token = base64.b64encode(b"alice:pa:ss").decode()
    assert _basic_credentials(Context([("authorization", f"Basic {token}")])) == ("alice", "pa:ss")
    for bad in (
        [],
        [("authorization", "Bearer x")],
        [("authorization", "Basic !!!")],
        [("authorization", "Basic eA==")],
    ):
        with pytest.raises(Refused) as refused:
            _basic_credentials(Context(bad))
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert scoped_publisher(Principal("alice"), "p") == "alice\x1fp"
    assert scoped_publisher(Principal(None), "p") == "p"


def test_passwords_are_hashed_and_checks_remembered() -> None:
    hashed = hash_password("s3cret")
    assert hashed.startswith("$argon2id$") and "s3cret" not in hashed
    assert matches(hashed, "s3cret") and not matches(hashed, "other") and not matches("not a hash", "x")
    assert password_problem("") is not None and password_problem("x" * 1025) is not None

    async def twice() -> tuple[bool, bool, bool]:
        checks = PasswordChecks()
        return (
            await checks.check("u", hashed, "s3cret"),
            await checks.check("u", hashed, "s3cret"),
            await checks.check("u", hashed, "nope"),
        )

    assert asyncio.run(twice()) == (True, True, False)


def test_access_records_seed_once_and_keep_what_depends_on_them(tmp_path: Path) -> None:
    store = SqliteStore(str(tmp_path / "c.db"))
    try:
        assert access_records.seed(store, lambda password: f"hash:{password}")
        assert not access_records.seed(store, lambda password: "again"), "seeded once"
        assert [u.name for u in access_records.list_users(store)] == ["guest"]
        assert access_records.list_vhosts(store) == ["/"]
        access_records.delete_user(store, "guest")
        assert not access_records.seed(store, hash_password), "a deleted guest stays deleted"
        assert access_records.list_permissions(store) == [], "the user's permissions went with it"
        with pytest.raises(ValueError):
            access_records.add_user(store, "bad\nname", "h", [])
        with pytest.raises(ValueError):
            access_records.add_user(store, "x", "h", ["root"])
        with pytest.raises(NotFound):
            access_records.set_permissions(store, Permission("ghost", "/", ".*", ".*", ".*"))
        access_records.add_user(store, "alice", "h", [])
        access_records.add_vhost(store, "v1")
        access_records.set_permissions(store, Permission("alice", "v1", ".*", "", ""))
        declare_queue(store, QueueRecord("v1", "q"), ["n1"])
        with pytest.raises(access_records.InUse):
            access_records.delete_vhost(store, "v1")
        assert access_records.list_permissions(store, vhost="v1") == [Permission("alice", "v1", ".*", "", "")]
    finally:
        store.close()


def test_a_cluster_can_start_with_an_administrator_of_its_own(tmp_path: Path) -> None:
    """`ringq coordinator --default-user admin` ($RINGQ_DEFAULT_PASSWORD): no guest, and the
    administrator may connect from anywhere (only guest is held to loopback)."""
    store = SqliteStore(str(tmp_path / "c.db"))
    try:
        assert access_records.seed(store, lambda password: f"hash:{password}", "admin", "s3cret")
        users = access_records.list_users(store)
        assert [(u.name, u.password_hash, sorted(u.tags)) for u in users] == [
            ("admin", "hash:s3cret", ["administrator"])
        ]
        table = AccessTable.of(users, access_records.list_vhosts(store), access_records.list_permissions(store))
        assert table.login_problem("admin", loopback=False) is None
        assert table.permission_problem("admin", "/", Operation.CONFIGURE, "anything") is None
    finally:
        store.close()


class _Coordinator:
    """ReadAccess answers: each call gives the next table (the last one again once they run out)."""

    def __init__(self, *tables: Any) -> None:
        self.tables = list(tables)
        self.reads = 0

    async def call(self, method: Any, request: Any) -> Any:
        self.reads += 1
        return self.tables.pop(0) if len(self.tables) > 1 else self.tables[0]


class _Call:
    def __init__(self, user: str, password: str) -> None:
        self.token = base64.b64encode(f"{user}:{password}".encode()).decode()

    def auth_context(self) -> dict[str, list[bytes]]:
        return {"transport_security_type": [b"ssl"]}

    def invocation_metadata(self) -> Any:
        return [("authorization", f"Basic {self.token}")]

    def peer(self) -> str:
        return "ipv4:10.1.2.3:5000"


def test_a_user_created_or_granted_through_another_node_is_not_refused_while_the_watch_lags() -> None:
    """The demo's first declare as a user it had just created got UNAUTHENTICATED from a node whose
    watch had not delivered the new user yet: a refusal re-reads the table first."""
    from ringq.internal.v1 import coordinator_pb2
    from ringq.v1 import access_pb2
    from services.access_guard import AccessGuard

    before = coordinator_pb2.ReadAccessResponse(vhosts=["/"])
    alice = coordinator_pb2.StoredUser(name="alice", password_hash=hash_password("pw"))
    after_user = coordinator_pb2.ReadAccessResponse(vhosts=["/"], users=[alice])
    grant = access_pb2.Permission(user="alice", vhost="/", configure=".*", write=".*", read=".*")
    after_grant = coordinator_pb2.ReadAccessResponse(vhosts=["/"], users=[alice], permissions=[grant])
    coordinator = _Coordinator(before, after_user, after_grant)

    async def scenario() -> None:
        guard = AccessGuard(coordinator, enforced=True)  # type: ignore[arg-type]
        await guard.load()  # just read, as at a node's start: the refusal re-reads it all the same
        principal = await guard.principal(_Call("alice", "pw"))
        assert principal == Principal("alice")
        guard._refusal_reload_at = float("-inf")  # a while later
        await guard.permit(principal, "/", Operation.WRITE, "orders")
        # A wrong password is still refused, and re-reads at most once per interval.
        reads = coordinator.reads
        for _ in range(5):
            with pytest.raises(Refused) as refused:
                await guard.principal(_Call("alice", "wrong"))
            assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert coordinator.reads - reads <= 1

    asyncio.run(scenario())
