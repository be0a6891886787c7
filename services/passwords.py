"""Passwords: hashed with Argon2id (argon2-cffi), checked with a bound on the cost.

Responsible for: turning a password into the hash the coordinator stores, and checking a password a
client presents against it on a node. Guarantees: no password is stored or logged, only its hash;
a node checks at most MAX_CONCURRENT_CHECKS passwords at once (each check costs tens of
milliseconds and 64 MiB, so a flood of wrong passwords cannot exhaust the node), and remembers the
outcome for a (user, hash, password) it has checked, so a client's calls cost one check, not one each.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
from collections import OrderedDict

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError

MAX_PASSWORD_BYTES = 1024
MAX_CONCURRENT_CHECKS = 2
REMEMBERED_CHECKS = 4096

_HASHER = PasswordHasher()


def password_problem(password: str) -> str | None:
    size = len(password.encode())
    if not 1 <= size <= MAX_PASSWORD_BYTES:
        return f"password must be 1 to {MAX_PASSWORD_BYTES} bytes, got {size}"
    return None


def hash_password(password: str) -> str:
    """The Argon2id hash of `password` (slow on purpose: call it from a worker thread)."""
    return _HASHER.hash(password)


def matches(password_hash: str, password: str) -> bool:
    """Whether `password` is the one `password_hash` was made from (slow: a worker thread)."""
    try:
        return _HASHER.verify(password_hash, password)
    except (VerifyMismatchError, VerificationError, InvalidHashError):
        return False


class PasswordChecks:
    """Checks passwords on a node: bounded in concurrency, outcomes remembered (LRU)."""

    def __init__(self) -> None:
        self._slots = asyncio.Semaphore(MAX_CONCURRENT_CHECKS)
        self._key = os.urandom(32)  # what is remembered is a keyed digest, never the password
        self._outcomes: OrderedDict[bytes, bool] = OrderedDict()

    async def check(self, user: str, password_hash: str, password: str) -> bool:
        digest = hmac.new(self._key, f"{user}\0{password_hash}\0{password}".encode(), hashlib.sha256).digest()
        known = self._outcomes.get(digest)
        if known is not None:
            self._outcomes.move_to_end(digest)
            return known
        async with self._slots:
            outcome = await asyncio.to_thread(matches, password_hash, password)
        self._outcomes[digest] = outcome
        while len(self._outcomes) > REMEMBERED_CHECKS:
            self._outcomes.popitem(last=False)
        return outcome
