"""Joining a GM group from Python: a thin asyncio client of ringq.v1.GroupService.

A `GroupMembership` is one member of a group, hosted by the node it called.
Events (deliveries, membership changes) arrive in the member's order through
`events()`; `broadcast()` sends to every member, the sender included. Failures
are `ringq.errors.RingqError`s, as in the rest of the SDK.

    membership = await GroupMembership.join("127.0.0.1:7101", "orders")
    await membership.broadcast([b"hello"], confirmed=True)
    async for event in membership.events():
        ...
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

from ringq.errors import from_rpc_error
from ringq.security import TLS, Credentials, aio_channel, authenticated
from ringq.v1 import group_pb2, group_pb2_grpc

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]


class GroupMembership:
    """One member of a group; create it with `await GroupMembership.join(...)`."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        call: Any,
        joined: group_pb2.Joined,
        credentials: Credentials | None = None,
        address: str | None = None,
    ) -> None:
        self._channel = channel
        self._call = call
        self._stub = authenticated(group_pb2_grpc.GroupServiceStub(channel), credentials)
        self.joined = joined
        self.member_id = joined.member
        self.address = address

    @classmethod
    async def join(
        cls,
        address: str,
        group: str,
        timeout: float = 30.0,
        *,
        tls: TLS | None = None,
        credentials: Credentials | None = None,
    ) -> GroupMembership:
        """Join `group` as a member hosted by the node at `address` (as `credentials`' user, over `tls`)."""
        channel = aio_channel(address, tls, CHANNEL_OPTIONS)
        stub = authenticated(group_pb2_grpc.GroupServiceStub(channel), credentials)
        call: Any = stub.Join(group_pb2.JoinRequest(group=group))
        try:
            first: Any = await asyncio.wait_for(call.read(), timeout)
        except BaseException as error:
            call.cancel()
            await channel.close(None)
            if isinstance(error, grpc.RpcError):
                raise from_rpc_error(error, address) from None
            raise
        if first is grpc.aio.EOF or first.WhichOneof("kind") != "joined":  # type: ignore[attr-defined]
            await channel.close(None)
            raise ConnectionError(f"joining {group} at {address} did not start with Joined")
        return cls(channel, call, first.joined, credentials, address)

    async def broadcast(self, payloads: list[bytes], confirmed: bool = False) -> tuple[int, int]:
        """Broadcast `payloads`; returns their first and last sequence numbers."""
        request = group_pb2.BroadcastRequest(member=self.member_id, payloads=payloads, confirmed=confirmed)
        try:
            response = await self._stub.Broadcast(request)
        except grpc.RpcError as error:
            raise from_rpc_error(error, self.address) from None
        return response.first_seq, response.last_seq

    async def events(self) -> AsyncIterator[group_pb2.JoinResponse]:
        """The member's events after Joined, until it leaves or its node fails."""
        while True:
            try:
                event: Any = await self._call.read()
            except grpc.RpcError as error:
                raise from_rpc_error(error, self.address) from None
            if event is grpc.aio.EOF:  # type: ignore[attr-defined]
                return
            yield event

    async def leave(self) -> None:
        """Leave the group gracefully."""
        try:
            await self._stub.Leave(group_pb2.LeaveRequest(member=self.member_id))
        except grpc.RpcError as error:
            raise from_rpc_error(error, self.address) from None
        finally:
            await self.close()

    async def close(self) -> None:
        """Drop the connection (the node makes the member leave)."""
        self._call.cancel()
        await self._channel.close(None)


class DeliveryCheck:
    """Follows one member's events and checks the ring's promise as they arrive:
    each publisher's messages come consecutively from the member's join point
    (no hole, no duplicate, publisher order), and deaths are recorded.

        check = DeliveryCheck(membership.joined)
        async for event in membership.events():
            check.observe(event)
        assert not check.problems
    """

    def __init__(self, joined: group_pb2.Joined, keep_bodies: bool = False) -> None:
        self.start_after: dict[str, int] = dict(joined.start_after)
        self.last: dict[str, int] = dict(self.start_after)
        self.keep_bodies = keep_bodies
        self.bodies: dict[str, list[bytes]] = {}
        self.delivered = 0
        self.deaths: set[str] = set()
        self.births: set[str] = set()
        self.problems: list[str] = []

    def observe(self, event: group_pb2.JoinResponse) -> None:
        kind = event.WhichOneof("kind")
        if kind == "delivery":
            delivery = event.delivery
            expected = self.last.get(delivery.publisher, 0) + 1
            if delivery.first_seq != expected:
                self.problems.append(f"{delivery.publisher}#{delivery.first_seq} delivered, expected #{expected}")
            self.last[delivery.publisher] = delivery.first_seq + len(delivery.payloads) - 1
            self.delivered += len(delivery.payloads)
            if self.keep_bodies:
                self.bodies.setdefault(delivery.publisher, []).extend(delivery.payloads)
        elif kind == "members_changed":
            self.deaths.update(event.members_changed.deaths)
            self.births.update(event.members_changed.births)

    async def follow(self, membership: GroupMembership) -> None:
        """Observe `membership`'s events until its stream ends."""
        async for event in membership.events():
            self.observe(event)
