"""ringqctl's access commands: users, vhosts and permissions (RabbitMQ's rabbitmqctl verbs).

    add_user NAME [PASSWORD] [--tags administrator,monitoring] delete_user NAME
    change_password NAME PASSWORD     clear_password NAME      list_users
    add_vhost NAME       delete_vhost NAME                     list_vhosts
    set_permissions [-p VHOST] USER CONFIGURE WRITE READ       clear_permissions [-p VHOST] USER
    list_permissions [-p VHOST] [--user USER]

Each is one AdminService call on a node; the node answers from the coordinator. Passwords are sent
over the connection (use TLS) and stored only as hashes. A user without a password (add_user with
none, or clear_password) authenticates only with a client certificate naming it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, Protocol

from ringq.ctl_output import as_json, table
from ringq.v1 import access_pb2

_Handler = Callable[[Any, argparse.Namespace], tuple[Any, str]]


class _Command(Protocol):
    def __call__(self, name: str, run: _Handler, text: str) -> Any: ...


def _tags(text: str) -> list[str]:
    return [tag.strip() for tag in text.split(",") if tag.strip()]


def add_user(c: Any, args: argparse.Namespace) -> tuple[Any, str]:
    request = access_pb2.AddUserRequest(name=args.name, password=args.password, tags=_tags(args.tags))
    how = "" if args.password else " (no password: it authenticates with a client certificate)"
    return as_json(c.call(lambda s: s.AddUser, request)), f"user {args.name!r} added{how}"


def delete_user(c: Any, args: argparse.Namespace) -> tuple[Any, str]:
    response = c.call(lambda s: s.DeleteUser, access_pb2.DeleteUserRequest(name=args.name))
    return as_json(response), f"user {args.name!r} deleted, with its permissions"


def change_password(c: Any, args: argparse.Namespace) -> tuple[Any, str]:
    request = access_pb2.ChangePasswordRequest(name=args.name, password=args.password)
    return as_json(c.call(lambda s: s.ChangePassword, request)), f"password of {args.name!r} changed"


def clear_password(c: Any, args: argparse.Namespace) -> tuple[Any, str]:
    request = access_pb2.ChangePasswordRequest(name=args.name, password="")
    response = c.call(lambda s: s.ChangePassword, request)
    return as_json(response), f"password of {args.name!r} cleared: it authenticates with a client certificate only"


def list_users(c: Any, args: argparse.Namespace) -> tuple[Any, str]:
    response = c.call(lambda s: s.ListUsers, access_pb2.ListUsersRequest())
    rows = [[user.name, ",".join(user.tags) or "-"] for user in response.users]
    return as_json(response), table(rows, ["user", "tags"])


def add_vhost(c: Any, args: argparse.Namespace) -> tuple[Any, str]:
    return as_json(
        c.call(lambda s: s.AddVhost, access_pb2.AddVhostRequest(name=args.name))
    ), f"vhost {args.name!r} added"


def delete_vhost(c: Any, args: argparse.Namespace) -> tuple[Any, str]:
    response = c.call(lambda s: s.DeleteVhost, access_pb2.DeleteVhostRequest(name=args.name))
    return as_json(response), f"vhost {args.name!r} deleted, with its permissions and policies"


def list_vhosts(c: Any, args: argparse.Namespace) -> tuple[Any, str]:
    response = c.call(lambda s: s.ListVhosts, access_pb2.ListVhostsRequest())
    return as_json(response), table([[vhost] for vhost in response.vhosts], ["vhost"])


def set_permissions(c: Any, args: argparse.Namespace) -> tuple[Any, str]:
    permission = access_pb2.Permission(
        user=args.user, vhost=args.vhost, configure=args.configure, write=args.write, read=args.read
    )
    response = c.call(lambda s: s.SetPermissions, access_pb2.SetPermissionsRequest(permission=permission))
    return as_json(response), f"permissions of {args.user!r} in vhost {args.vhost!r} set"


def clear_permissions(c: Any, args: argparse.Namespace) -> tuple[Any, str]:
    request = access_pb2.ClearPermissionsRequest(user=args.user, vhost=args.vhost)
    response = c.call(lambda s: s.ClearPermissions, request)
    return as_json(response), f"permissions of {args.user!r} in vhost {args.vhost!r} cleared"


def list_permissions(c: Any, args: argparse.Namespace) -> tuple[Any, str]:
    request = access_pb2.ListPermissionsRequest(vhost=args.vhost or "", user=args.user or "")
    response = c.call(lambda s: s.ListPermissions, request)
    rows = [[p.vhost, p.user, p.configure, p.write, p.read] for p in response.permissions]
    return as_json(response), table(rows, ["vhost", "user", "configure", "write", "read"])


def add_commands(command: _Command) -> None:
    """Add the access verbs with `command(name, run, help)`, which returns the verb's parser."""
    sub = command("add_user", add_user, "create a user (or replace its password and tags)")
    sub.add_argument("name")
    sub.add_argument("password", nargs="?", default="", help="none: the user logs in with a client certificate only")
    sub.add_argument("--tags", default="", help="comma-separated: administrator, monitoring, policymaker, management")
    command("delete_user", delete_user, "delete a user and its permissions").add_argument("name")
    sub = command("change_password", change_password, "set a user's password")
    sub.add_argument("name")
    sub.add_argument("password")
    command("clear_password", clear_password, "remove a user's password (client certificate only)").add_argument("name")
    command("list_users", list_users, "list users and their tags")
    command("add_vhost", add_vhost, "create a vhost").add_argument("name")
    command("delete_vhost", delete_vhost, "delete a vhost that has no queues, with its permissions").add_argument(
        "name"
    )
    command("list_vhosts", list_vhosts, "list vhosts")
    sub = command("set_permissions", set_permissions, "set a user's configure, write and read patterns in a vhost")
    sub.add_argument("-p", "--vhost", default="/", help="vhost (default /)")
    sub.add_argument("user")
    for operation in ("configure", "write", "read"):
        sub.add_argument(operation, help=f"RE2 pattern of the names the user may {operation} ('' : none)")
    sub = command("clear_permissions", clear_permissions, "remove a user's permissions in a vhost")
    sub.add_argument("-p", "--vhost", default="/", help="vhost (default /)")
    sub.add_argument("user")
    sub = command("list_permissions", list_permissions, "list permissions")
    sub.add_argument("-p", "--vhost", default="", help="only this vhost")
    sub.add_argument("--user", default="", help="only this user")
