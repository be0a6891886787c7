"""Leases with fencing tokens: who may act as the single active producer or
consumer of a stream, or as anything else that must have one holder at a time.

Responsible for: the pure rules of acquiring, renewing, releasing and
checking a lease, given the lease as stored and the coordinator's clock.
Guarantees:
- At most one holder at any instant by the coordinator's clock, because every
  transition is written by compare-and-set (records are versioned) and is
  computed from the stored lease.
- The fencing token increases by one each time the lease passes to a new
  holder and never decreases, not even across release or expiry. A holder
  that lost its lease (expired, taken over) still carries its old token, and
  every write it attempts with it is refused by `check`: stronger than asking
  the old holder to stop, since a paused process cannot be asked anything.
- A renewal by the current holder keeps its token.
Clocks: expiry is judged on the coordinator's clock (milliseconds); holders
should renew well before `ttl_ms` (a third of it is usual).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

MIN_TTL_MS = 100
MAX_TTL_MS = 24 * 3600 * 1000


@dataclass(frozen=True)
class Lease:
    """A lease as stored. `holder` is empty while nobody holds it."""

    name: str
    holder: str = ""
    token: int = 0
    expires_at_ms: int = 0

    def held_at(self, now_ms: int) -> bool:
        return bool(self.holder) and now_ms < self.expires_at_ms


class LeaseRefused(Exception):
    """The lease operation is not allowed; `reason` says why in one line."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _check_ttl(ttl_ms: int) -> None:
    if not MIN_TTL_MS <= ttl_ms <= MAX_TTL_MS:
        raise LeaseRefused(f"ttl_ms must be between {MIN_TTL_MS} and {MAX_TTL_MS}, got {ttl_ms}")


def acquire(current: Lease | None, name: str, holder: str, now_ms: int, ttl_ms: int) -> Lease:
    """The lease after `holder` asks for it: granted (with a new token) if free or
    expired, extended if `holder` already holds it; LeaseRefused if someone else does."""
    _check_ttl(ttl_ms)
    if not holder:
        raise LeaseRefused("holder must not be empty")
    lease = current or Lease(name)
    if lease.held_at(now_ms):
        if lease.holder != holder:
            remaining = lease.expires_at_ms - now_ms
            raise LeaseRefused(f"lease {name!r} is held by {lease.holder!r} for another {remaining} ms")
        return replace(lease, expires_at_ms=now_ms + ttl_ms)
    return Lease(name, holder, lease.token + 1, now_ms + ttl_ms)


def renew(current: Lease | None, holder: str, token: int, now_ms: int, ttl_ms: int) -> Lease:
    """Extend the lease of a holder that still holds it with this token."""
    _check_ttl(ttl_ms)
    if current is None or not check(current, holder, token, now_ms):
        raise LeaseRefused(_lost(current, holder, token, now_ms))
    return replace(current, expires_at_ms=now_ms + ttl_ms)


def release(current: Lease | None, holder: str, token: int, now_ms: int) -> Lease:
    """Give the lease up; the token is kept so the next holder's is higher."""
    if current is None or not check(current, holder, token, now_ms):
        raise LeaseRefused(_lost(current, holder, token, now_ms))
    return replace(current, holder="", expires_at_ms=0)


def check(current: Lease, holder: str, token: int, now_ms: int) -> bool:
    """True if `holder` holds the lease with `token` now: the fencing check."""
    return current.held_at(now_ms) and current.holder == holder and current.token == token


def _lost(current: Lease | None, holder: str, token: int, now_ms: int) -> str:
    if current is None or current.token == 0:
        return "no such lease"
    if current.token != token:
        return f"stale fencing token {token}: the lease is at token {current.token}"
    if current.holder != holder:
        return f"{holder!r} does not hold the lease"
    return f"the lease expired {now_ms - current.expires_at_ms} ms ago"
