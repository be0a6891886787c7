"""Argument rules and value encoding shared by every `Store` implementation.

Responsible for: refusing the same bad kinds, keys, values and versions in
every store (so the contract tests hold for all of them), and the one JSON
encoding of record values.
Guarantees: a value that passes `encode_value` fits in one ZooKeeper request
together with its change-log copy; `decode_value(encode_value(v))` is what a
later `get` returns (tuples become lists, key order is kept).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from services.coordinator.store import MAX_KEY_LENGTH

# ZooKeeper refuses requests over jute.maxbuffer (1 MiB by default, and it drops
# the connection rather than answering); a write carries the value twice.
MAX_VALUE_BYTES = 256 * 1024


def check_name(kind: str, key: str) -> None:
    """ValueError unless `kind` and `key` are non-empty, printable and at most MAX_KEY_LENGTH characters."""
    for field, text in (("kind", kind), ("key", key)):
        if not isinstance(text, str):
            raise ValueError(f"{field} must be a string, got {type(text).__name__}")
        if not text:
            raise ValueError(f"{field} must not be empty")
        if len(text) > MAX_KEY_LENGTH:
            raise ValueError(f"{field} must be at most {MAX_KEY_LENGTH} characters, got {len(text)}")
        if not text.isprintable():  # also refuses NUL, newlines and lone surrogates
            raise ValueError(f"{field} must be printable, got {text!r}")


def check_kind(kind: str) -> None:
    """ValueError unless `kind` is a valid kind (see `check_name`)."""
    check_name(kind, "-")


def check_expected_version(expected_version: int) -> None:
    """ValueError unless `expected_version` is a version (0: absent) a write can expect."""
    if isinstance(expected_version, bool) or not isinstance(expected_version, int) or expected_version < 0:
        raise ValueError(f"expected_version must be an integer >= 0, got {expected_version!r}")


def check_retained(change_log_retained: int) -> None:
    """ValueError unless the change log may keep `change_log_retained` entries."""
    if change_log_retained < 1:
        raise ValueError(f"change_log_retained must be at least 1, got {change_log_retained}")


def encode_value(value: Mapping[str, Any]) -> str:
    """Compact JSON for `value`; TypeError if it is not a JSON object, ValueError if it is too large."""
    if not isinstance(value, Mapping):
        raise TypeError(f"value must be a mapping, got {type(value).__name__}")
    text = json.dumps(dict(value), separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    if len(text.encode()) > MAX_VALUE_BYTES:
        raise ValueError(f"value must encode to at most {MAX_VALUE_BYTES} bytes of JSON")
    return text


def decode_value(text: str | bytes) -> dict[str, Any]:
    """The value `encode_value` encoded."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"stored value is not a JSON object: {text!r:.80}")
    return value
