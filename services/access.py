"""Who may do what: users, vhosts and permissions in RabbitMQ's model, as a pure table.

Responsible for: the rules a node applies to every public call once the cluster runs with TLS.
  - A user has a password (kept as an Argon2id hash, services/passwords.py) and tags:
    administrator, monitoring, policymaker, management.
  - A user may act in a vhost only with a permission there: three RE2 regular expressions
    searched in the names it acts on. `configure` covers declare, delete and sync; `write` covers
    publish; `read` covers consume, get, settle, purge and status. "" matches nothing.
  - Cluster administration needs tags: listing needs any tag, policies need administrator or
    policymaker, everything else administrator.
  - The default user `guest` works only from loopback, as in RabbitMQ.
Guarantees: every decision is a function of the table and the request, with no I/O; each refusal
is a sentence that names the user, the vhost, the operation and the name, for PERMISSION_DENIED.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from services.coordinator.policies import compiled_pattern

TAGS = ("administrator", "monitoring", "policymaker", "management")
GUEST = "guest"
DEFAULT_VHOST = "/"


class Operation(enum.Enum):
    CONFIGURE = "configure"
    WRITE = "write"
    READ = "read"


@dataclass(frozen=True)
class User:
    name: str
    password_hash: str
    tags: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Permission:
    user: str
    vhost: str
    configure: str = ""
    write: str = ""
    read: str = ""

    def pattern(self, operation: Operation) -> str:
        return {Operation.CONFIGURE: self.configure, Operation.WRITE: self.write, Operation.READ: self.read}[operation]


# What administration needs: any of these tags.
LISTING = frozenset(TAGS)
POLICIES = frozenset({"administrator", "policymaker"})
ADMINISTRATION = frozenset({"administrator"})


@dataclass(frozen=True)
class AccessTable:
    """Every user, vhost and permission of the cluster, as last read from the coordinator."""

    users: Mapping[str, User] = field(default_factory=dict)
    vhosts: frozenset[str] = frozenset()
    permissions: Mapping[tuple[str, str], Permission] = field(default_factory=dict)

    @classmethod
    def of(cls, users: Iterable[User], vhosts: Iterable[str], permissions: Iterable[Permission]) -> AccessTable:
        return cls(
            {user.name: user for user in users},
            frozenset(vhosts),
            {(permission.user, permission.vhost): permission for permission in permissions},
        )

    def login_problem(self, name: str, loopback: bool) -> str | None:
        """Why user `name` may not log in from where the call came (before its password is checked)."""
        if name not in self.users:
            return "unknown user or wrong password"
        if name == GUEST and not loopback:
            return f"user {GUEST!r} may connect only from loopback (RabbitMQ's rule): create a user of your own"
        return None

    def permission_problem(self, user: str, vhost: str, operation: Operation, name: str) -> str | None:
        """Why `user` may not `operation` the queue, stream or group `name` of `vhost`, or None."""
        if vhost not in self.vhosts:
            return f"no vhost {vhost!r}"
        permission = self.permissions.get((user, vhost))
        if permission is None:
            return f"user {user!r} has no permissions in vhost {vhost!r}"
        pattern = permission.pattern(operation)
        if not pattern or compiled_pattern(pattern).search(name) is None:
            return (
                f"user {user!r} may not {operation.value} {name!r} in vhost {vhost!r} ({operation.value}: {pattern!r})"
            )
        return None

    def vhost_problem(self, user: str, vhost: str) -> str | None:
        """Why `user` may not see `vhost` at all (no permission there), or None."""
        if vhost not in self.vhosts:
            return f"no vhost {vhost!r}"
        if (user, vhost) not in self.permissions:
            return f"user {user!r} has no permissions in vhost {vhost!r}"
        return None

    def tag_problem(self, user: str, needed: frozenset[str], what: str) -> str | None:
        """Why `user` may not do `what`, which needs one of the tags `needed`, or None."""
        tags = self.users[user].tags if user in self.users else frozenset()
        if tags & needed:
            return None
        return f"user {user!r} may not {what}: it needs the tag {' or '.join(sorted(needed))}"


def tags_problem(tags: Iterable[str]) -> str | None:
    unknown = sorted(set(tags) - set(TAGS))
    return f"unknown tags {unknown}: known tags are {', '.join(TAGS)}" if unknown else None
