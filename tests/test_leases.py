"""Leases and fencing tokens (services/coordinator/leases.py)."""

from __future__ import annotations

import random

import pytest

from services.coordinator.leases import Lease, LeaseRefused, acquire, check, release, renew

TTL = 1000


def test_a_free_lease_is_granted_with_the_first_token() -> None:
    lease = acquire(None, "orders.producer", "p1", now_ms=0, ttl_ms=TTL)
    assert lease == Lease("orders.producer", "p1", 1, TTL)
    assert check(lease, "p1", 1, now_ms=TTL - 1) and not check(lease, "p1", 1, now_ms=TTL)


def test_a_held_lease_is_refused_to_others_and_extended_for_its_holder() -> None:
    lease = acquire(None, "l", "p1", 0, TTL)
    with pytest.raises(LeaseRefused, match="held by 'p1' for another 500 ms"):
        acquire(lease, "l", "p2", 500, TTL)
    again = acquire(lease, "l", "p1", 500, TTL)
    assert again.token == 1 and again.expires_at_ms == 500 + TTL


def test_expiry_hands_the_lease_on_with_a_higher_token() -> None:
    first = acquire(None, "l", "p1", 0, TTL)
    second = acquire(first, "l", "p2", TTL, TTL)
    assert (second.holder, second.token) == ("p2", 2)
    assert not check(second, "p1", 1, TTL + 1), "the old holder's token is refused"


def test_renewal_keeps_the_token_and_fails_once_lost() -> None:
    lease = acquire(None, "l", "p1", 0, TTL)
    lease = renew(lease, "p1", 1, 900, TTL)
    assert (lease.token, lease.expires_at_ms) == (1, 1900)
    with pytest.raises(LeaseRefused, match="expired 100 ms ago"):
        renew(lease, "p1", 1, 2000, TTL)
    taken = acquire(lease, "l", "p2", 2000, TTL)
    with pytest.raises(LeaseRefused, match="stale fencing token 1"):
        renew(taken, "p1", 1, 2001, TTL)


def test_release_keeps_the_token_so_the_next_holder_gets_a_higher_one() -> None:
    lease = release(acquire(None, "l", "p1", 0, TTL), "p1", 1, 10)
    assert (lease.holder, lease.token) == ("", 1) and not lease.held_at(10)
    assert acquire(lease, "l", "p2", 11, TTL).token == 2
    with pytest.raises(LeaseRefused, match="does not hold"):
        release(acquire(None, "l", "p1", 0, TTL), "p2", 1, 10)


@pytest.mark.parametrize("ttl", [0, 99, 24 * 3600 * 1000 + 1])
def test_unreasonable_ttls_are_refused(ttl: int) -> None:
    with pytest.raises(LeaseRefused, match="ttl_ms"):
        acquire(None, "l", "p", 0, ttl)


def test_two_contenders_never_both_hold_and_tokens_only_grow() -> None:
    """Random interleavings of acquire/renew/release by three contenders over a
    stored lease: at every instant at most one holds it, tokens never decrease."""
    rng = random.Random(7)
    stored: Lease | None = None
    tokens: dict[str, int] = {}
    now = 0
    last_token = 0
    for _ in range(20_000):
        now += rng.randint(0, 400)
        who = rng.choice(["p1", "p2", "p3"])
        action = rng.random()
        try:
            if action < 0.5:
                stored = acquire(stored, "l", who, now, TTL)
                tokens[who] = stored.token
            elif action < 0.8 and who in tokens:
                stored = renew(stored, who, tokens[who], now, TTL)
            elif who in tokens:
                stored = release(stored, who, tokens[who], now)
        except LeaseRefused:
            pass
        assert stored is None or stored.token >= last_token
        last_token = stored.token if stored else 0
        holders = [p for p, t in tokens.items() if stored is not None and check(stored, p, t, now)]
        assert len(holders) <= 1, holders
