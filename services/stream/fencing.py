"""The fencing check of ordered streams on a node: is this token the one of the stream's producer (or
consumer) lease, now?

Responsible for: answering, per batch and without a coordinator round trip on the hot path, whether a
fencing token is current, from the lease as last read from the coordinator. Guarantees: a token is taken
as current only while the lease read says it is, judged on this node's own monotonic clock from *before*
the read was sent (remaining time as the coordinator answered, counted from the moment the question
left): the coordinator grants the lease to another holder only after that moment has passed on its own
clock, so this node stops accepting the old token no later than the coordinator could hand out the next
one (clock rates assumed equal; no clock offsets are involved). A token lower than one already seen is
refused without asking anyone (tokens never decrease).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from services.coordinator.stream_records import stream_key

PRODUCER = "producer"
CONSUMER = "consumer"


def lease_name(vhost: str, stream: str, role: str) -> str:
    """The coordinator lease of a stream's producer or consumer."""
    return f"stream:{stream_key(vhost, stream)}:{role}"


@dataclass(frozen=True)
class LeaseRead:
    """A lease as the coordinator answered: its token, its holder, and how long it lasts from then."""

    token: int
    holder: str
    remaining_ms: int


@dataclass(frozen=True)
class _Known:
    token: int
    valid_until: float  # on this node's monotonic clock


class StaleToken(Exception):
    """The token is not the current one of the lease; the message says why."""


class FencingCheck:
    """Current-token checks for every lease this node has been asked about."""

    def __init__(self, read: Callable[[str], Awaitable[LeaseRead]], clock: Callable[[], float] = time.monotonic):
        self._read = read
        self._clock = clock
        self._known: dict[str, _Known] = {}
        self._highest: dict[str, int] = {}

    def current(self, name: str, token: int) -> bool:
        """True if `token` is known current now (no I/O): the hot path."""
        known = self._known.get(name)
        return known is not None and known.token == token and self._clock() < known.valid_until

    async def check(self, name: str, token: int) -> None:
        """Return if `token` is current (asking the coordinator when this node does not know); StaleToken
        otherwise."""
        if token == 0:
            raise StaleToken("no fencing token: acquire the stream's lease first (AcquireStreamLease)")
        if self.current(name, token):
            return
        highest = self._highest.get(name, 0)
        if token < highest:
            raise StaleToken(f"fencing token {token} is stale: the lease has passed to token {highest}")
        asked_at = self._clock()
        lease = await self._read(name)
        self._highest[name] = max(highest, lease.token)
        if lease.remaining_ms > 0:
            self._known[name] = _Known(lease.token, asked_at + lease.remaining_ms / 1000)
        if lease.token != token or lease.remaining_ms <= 0:
            if lease.token > token:
                raise StaleToken(f"fencing token {token} is stale: the lease has passed to token {lease.token}")
            raise StaleToken(
                f"fencing token {token} is not current: the lease (token {lease.token}) "
                + ("has expired; acquire it again" if lease.remaining_ms <= 0 else "is held with another token")
            )
        # A check started before a later one finished may arrive last: keep the later deadline.
        known = self._known.get(name)
        if known is not None and known.token == token and self._clock() >= known.valid_until:
            raise StaleToken(f"fencing token {token} expired while it was being checked")
