"""The nodes an SDK client talks to: a channel to each, which one is current, and what each said last.

Responsible for: opening one asyncio channel per address (on first use, with the client's TLS), the
address calls go to now and moving on from it, remembering the last failure of each address, and the
connect phase: until some node of the list has accepted a connection, `reach()` dials every address at
once (the first in the list that connects is used, the list being a preference) and gives up after
`connect_timeout` seconds with a `ConnectionFailed` naming each address and why.

Guarantees: `reach()` returns at once once a node has been reached (later failures are failovers, which
the callers retry for their `retry_for`); against a cluster that is down it raises within
`connect_timeout` seconds plus at most PROBE_SECONDS (spent asking each channel why it failed, all at
once), never the 30 s of the failover retries.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from typing import Any

import grpc

from ringq.errors import ConnectionFailed, attempts_text, describe, status_of
from ringq.keepalive import CHANNEL_KEEPALIVE
from ringq.security import TLS, aio_channel

CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 1000),
    *CHANNEL_KEEPALIVE,  # a node cut off by a partition is left within seconds, not minutes
]
PROBE_SECONDS = 0.25
# While dialling: how often channel states are looked at, and how long a node that connected waits for an
# earlier one in the list that is still connecting (the list's order is a preference).
DIAL_POLL_SECONDS = 0.01
PREFER_SECONDS = 0.5
# A method no node serves on its client port: a call of it on a failed channel fails at once with the reason
# the channel failed, and on one that connected meanwhile the node answers UNIMPLEMENTED, harmlessly.
_PROBE_METHOD = "/ringq.v1.QueueService/ConnectProbe"
_CONNECT_PREFIX = re.compile(r"^failed to connect to all addresses; last error: (?:[A-Z_]+: )?(?:ipv[46]:\S+: )?")


def connect_failure(details: str) -> str:
    """gRPC's text for a channel that could not connect, without the parts that repeat the address."""
    return _CONNECT_PREFIX.sub("", details) or details


def _first_connected(order: Sequence[str], states: dict[str, grpc.ChannelConnectivity]) -> str | None:
    """The first address of `order` that is connected, if every address before it failed to connect."""
    for address in order:
        state = states[address]
        if state == grpc.ChannelConnectivity.READY:
            return address
        if state not in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN):
            return None  # still connecting: it may yet answer
    return None


class Nodes:
    """The addresses of a cluster's nodes, in the order given, and a channel to each."""

    def __init__(
        self,
        addresses: Sequence[str] | str,
        *,
        tls: TLS | None,
        connect_timeout: float,
        options: Sequence[tuple[str, Any]] = CHANNEL_OPTIONS,
    ) -> None:
        self.addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        if not self.addresses:
            raise ValueError("at least one node address is needed")
        if connect_timeout <= 0:
            raise ValueError(f"connect_timeout must be positive, got {connect_timeout}")
        self.tls = tls
        self.connect_timeout = connect_timeout
        self.options = list(options)
        self.current = 0
        self.reached = False  # some node accepted a connection: failures from now on are failovers
        self.last_errors: dict[str, str] = {}  # address -> what it failed with last
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._reaching: asyncio.Lock | None = None

    @property
    def address(self) -> str:
        """The node calls go to now."""
        return self.addresses[self.current]

    def channel(self, address: str | None = None) -> grpc.aio.Channel:
        """The channel to `address` (default: the current node), opened on first use."""
        address = self.address if address is None else address
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = aio_channel(address, self.tls, self.options)
        return channel

    def next(self) -> None:
        """The current node failed: use the next one."""
        self.current = (self.current + 1) % len(self.addresses)

    def note(self, address: str, error: BaseException) -> None:
        """Remember what `address` failed with."""
        self.last_errors[address] = describe(error)

    def answered(self, address: str) -> None:
        """`address` answered a call: forget its last failure."""
        self.last_errors.pop(address, None)

    def attempts(self) -> dict[str, str]:
        """The addresses that failed, in the order given, with what each failed with last."""
        return {a: self.last_errors[a] for a in self.addresses if a in self.last_errors}

    async def reach(self) -> None:
        """Return once a node has accepted a connection: at once if one did before, else after dialling every
        address at the same time, making the first that connects current. ConnectionFailed if none did
        within connect_timeout seconds."""
        if self.reached:
            return
        if self._reaching is None:
            self._reaching = asyncio.Lock()
        async with self._reaching:
            if not self.reached:
                await self._dial_all()

    async def _dial_all(self) -> None:
        """Dial every address at once; the first in the given order (from the current one) that connects
        becomes current. A later one that connected wins once every earlier one has failed to connect, or
        after PREFER_SECONDS if an earlier one is still connecting (a host that does not answer at all)."""
        loop = asyncio.get_running_loop()
        probe = min(PROBE_SECONDS, self.connect_timeout / 4)
        deadline = loop.time() + self.connect_timeout - probe
        order = self.addresses[self.current :] + self.addresses[: self.current]
        later_ready_since: float | None = None
        while True:
            states = {a: self.channel(a).get_state(try_to_connect=True) for a in order}
            chosen = _first_connected(order, states)
            if chosen is None and any(s == grpc.ChannelConnectivity.READY for s in states.values()):
                later_ready_since = later_ready_since if later_ready_since is not None else loop.time()
                if loop.time() - later_ready_since >= PREFER_SECONDS:
                    chosen = next(a for a in order if states[a] == grpc.ChannelConnectivity.READY)
            if chosen is not None:
                self.current = self.addresses.index(chosen)
                self.reached = True
                return
            if loop.time() >= deadline:
                break
            await asyncio.sleep(DIAL_POLL_SECONDS)
        reasons = await asyncio.gather(*(self._why(a, probe) for a in self.addresses))
        attempts = dict(zip(self.addresses, reasons, strict=True))
        self.last_errors.update(attempts)
        raise ConnectionFailed(
            f"no ringq node accepted a connection within {self.connect_timeout:g} s: {attempts_text(attempts)}",
            details="no node accepted a connection",
            attempts=attempts,
        )

    async def _why(self, address: str, timeout: float) -> str:
        """Why the channel to `address` is not connected, as gRPC says it."""
        channel = self.channel(address)
        try:
            probe = channel.unary_unary(_PROBE_METHOD, request_serializer=None, response_deserializer=None)
            await probe(b"", timeout=timeout)
        except grpc.aio.AioRpcError as error:
            code, details = status_of(error)
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                return f"no answer within {self.connect_timeout:g} s (still connecting)"
            if code == grpc.StatusCode.UNAVAILABLE:
                return connect_failure(" ".join(details.split()))
            return "connected too late"  # it answered the probe: it came up just now
        return "connected too late"

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close(None)
        self._channels.clear()
