"""Users, vhosts and permissions as coordinator records (in the Store: SQLite or ZooKeeper).

Responsible for: creating, changing, deleting and listing the records services/access.py decides
with, each change a compare-and-set; seeding a new cluster with the vhost "/" and the user
guest/guest (administrator, every permission on "/"), once. Guarantees: names follow ringq.names,
tags are known ones, patterns are RE2 and bounded (ValueError otherwise, INVALID_ARGUMENT); a user
or vhost deleted takes its permissions with it; a vhost that still has queues is not deleted (InUse);
passwords arrive here already hashed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote

from ringq.names import check_name
from services.access import DEFAULT_VHOST, GUEST, Permission, User, tags_problem
from services.coordinator import metadata
from services.coordinator.metadata import NotFound, retry_until_set
from services.coordinator.policies import pattern_problem
from services.coordinator.store import Store

USER = "user"
VHOST = "vhost"
PERMISSION = "permission"
SEEDED = "access"  # kind of the one record that says the cluster was seeded
KINDS = (USER, VHOST, PERMISSION)


class InUse(Exception):
    """A record that others still depend on (a vhost with queues)."""


def _key(*parts: str) -> str:
    return "/".join(quote(part, safe="") for part in parts)


def _create_or_replace(store: Store, kind: str, key: str, value: dict[str, Any]) -> None:
    def step() -> bool | None:
        existing = store.get(kind, key)
        return True if store.put(kind, key, value, existing.version if existing else 0) is not None else None

    retry_until_set(step)


def _delete(store: Store, kind: str, key: str, missing: str) -> None:
    def step() -> bool | None:
        existing = store.get(kind, key)
        if existing is None:
            raise NotFound(missing)
        return True if store.delete(kind, key, existing.version) else None

    retry_until_set(step)


# -------------------------------------------------------------------------------------- users


def add_user(store: Store, name: str, password_hash: str, tags: Sequence[str]) -> None:
    check_name("name", name)
    if problem := tags_problem(tags):
        raise ValueError(problem)
    _create_or_replace(store, USER, _key(name), {"name": name, "password_hash": password_hash, "tags": sorted(tags)})


def change_password(store: Store, name: str, password_hash: str) -> None:
    def step() -> bool | None:
        existing = store.get(USER, _key(name))
        if existing is None:
            raise NotFound(f"no user {name!r}")
        value = {**existing.value, "password_hash": password_hash}
        return True if store.put(USER, _key(name), value, existing.version) is not None else None

    retry_until_set(step)


def delete_user(store: Store, name: str) -> None:
    _delete(store, USER, _key(name), f"no user {name!r}")
    for permission in list_permissions(store, user=name):
        _forget_permission(store, permission.user, permission.vhost)


def list_users(store: Store) -> list[User]:
    users = [
        User(r.value["name"], r.value["password_hash"], frozenset(r.value.get("tags", ()))) for r in store.list(USER)
    ]
    return sorted(users, key=lambda user: user.name)


# ------------------------------------------------------------------------------------- vhosts


def add_vhost(store: Store, name: str) -> None:
    check_name("name", name)
    if store.get(VHOST, _key(name)) is None:
        _create_or_replace(store, VHOST, _key(name), {"name": name})


def delete_vhost(store: Store, name: str) -> None:
    queues = metadata.list_queues(store, name)
    if queues:
        raise InUse(f"vhost {name!r} still has {len(queues)} queue(s): delete them first")
    _delete(store, VHOST, _key(name), f"no vhost {name!r}")
    for permission in list_permissions(store, vhost=name):
        _forget_permission(store, permission.user, permission.vhost)
    for policy in metadata.list_policies(store, name):
        metadata.delete_policy(store, policy.vhost, policy.name)


def list_vhosts(store: Store) -> list[str]:
    return sorted(str(record.value["name"]) for record in store.list(VHOST))


# -------------------------------------------------------------------------------- permissions


def set_permissions(store: Store, permission: Permission) -> None:
    for field, pattern in (
        ("configure", permission.configure),
        ("write", permission.write),
        ("read", permission.read),
    ):
        if problem := pattern_problem(pattern):
            raise ValueError(f"{field}: {problem}")
    if store.get(USER, _key(permission.user)) is None:
        raise NotFound(f"no user {permission.user!r}")
    if store.get(VHOST, _key(permission.vhost)) is None:
        raise NotFound(f"no vhost {permission.vhost!r}")
    value = {
        "user": permission.user,
        "vhost": permission.vhost,
        "configure": permission.configure,
        "write": permission.write,
        "read": permission.read,
    }
    _create_or_replace(store, PERMISSION, _key(permission.user, permission.vhost), value)


def clear_permissions(store: Store, user: str, vhost: str) -> None:
    _delete(store, PERMISSION, _key(user, vhost), f"user {user!r} has no permissions in vhost {vhost!r}")


def _forget_permission(store: Store, user: str, vhost: str) -> None:
    with contextlib.suppress(NotFound):  # gone meanwhile
        clear_permissions(store, user, vhost)


def list_permissions(store: Store, *, vhost: str = "", user: str = "") -> list[Permission]:
    found = [
        Permission(v["user"], v["vhost"], v["configure"], v["write"], v["read"])
        for v in (record.value for record in store.list(PERMISSION))
        if (not vhost or v["vhost"] == vhost) and (not user or v["user"] == user)
    ]
    return sorted(found, key=lambda p: (p.vhost, p.user))


# ------------------------------------------------------------------------------------ seeding


def seed(store: Store, hash_password: Callable[[str], str], user: str = GUEST, password: str = GUEST) -> bool:
    """On a cluster's first start: the vhost "/" and an administrator `user` (default guest/guest, which
    is accepted from loopback only) with every permission there. False if the cluster was seeded
    before (what administrators changed since is kept)."""
    if store.get(SEEDED, "seeded") is not None:
        return False
    add_vhost(store, DEFAULT_VHOST)
    if store.get(USER, _key(user)) is None:
        add_user(store, user, hash_password(password), ["administrator"])
    set_permissions(store, Permission(user, DEFAULT_VHOST, ".*", ".*", ".*"))
    store.put(SEEDED, "seeded", {"seeded": True}, 0)  # a concurrent seeder wrote the same
    return True
