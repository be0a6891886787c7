"""Queue policies: validation, normalisation and resolution (pure).

Responsible for: the rules behind `set_policy [-p VHOST] NAME PATTERN DEFINITION
[--priority N] [--apply-to queues|all]` (RabbitMQ's policy model, ARCHITECTURE.md
section 3): deciding whether a policy is acceptable, turning it into a
normalised value, choosing the one policy that applies to a queue, the floor
of synchronised mirrors below which a queue's master confirms nothing
(`min_synchronised`), and printing a definition for CLI tables. Callers (the
coordinator server, the CLI, the queue layer) do the storing and the applying.

Guarantees:

- Pure: no I/O, no clock, no randomness; arguments are never mutated.
- `validate` either returns a normalised copy or raises `PolicyError` for the
  FIRST problem found, in a fixed order: vhost, name, pattern, priority,
  apply-to, then the definition (empty, unknown keys in sorted key order, then
  each key in `DEFINITION_KEYS` order, a key's cross-key rules checked with
  it). The error names the key at fault (`PolicyError.key`) and says why.
- Normalised means: a fresh `dict` (never the caller's) with its keys sorted and
  ha-params of mode nodes as a `list[str]`; values are otherwise as written (no
  defaults are filled in, so what the user set is what the CLI shows). bool is
  never accepted where an int is expected, nor a float.
- `effective_policy` is a total order: the highest priority wins, a tie goes to
  the greatest name (then pattern, apply-to and definition, so even duplicate
  names resolve the same way every time).

Not promised (as in RabbitMQ): that a definition fits the cluster. `ha-params`
5 on a 3-node cluster is accepted (placement caps it), and `ha-mode nodes` may
name nodes that do not exist (yet). `ha-min-synchronised` is refused only when
the definition itself could never reach it (3 with ha-mode exactly 2); on a
cluster that has lost nodes a queue may well be below its floor, and then its
master stops confirming until mirrors are back and synchronised. Like
RabbitMQ, the ha-* keys other than ha-mode are refused without ha-mode: they
only mean something for a mirrored queue.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeGuard

import re2  # type: ignore[import-untyped]

from ringq.names import name_problem

# The longest time-to-live or expiry a policy, a queue or a message may ask for (AMQP's 32-bit
# unsigned milliseconds, about 49.7 days): longer values are refused, never wrapped or clamped.
MAX_TTL_MS = 2**32 - 1
# Policy patterns: at most this long, compiled once each (a cache far larger than any real policy set).
MAX_PATTERN_BYTES = 4096
MAX_COMPILED_PATTERNS = 65536
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a refused pattern is reported to the caller, not logged by RE2
_RE2_OPTIONS.never_capture = True  # only whether a name matches counts

MIN_PRIORITY = -(2**31)
MAX_PRIORITY = 2**31 - 1
APPLY_TO = ("all", "queues")

HA_MODES = ("all", "exactly", "nodes")
HA_SYNC_MODES = ("automatic", "manual")
HA_PROMOTE = ("always", "when-synced")
OVERFLOW = ("drop-head", "reject-publish")
QUEUE_MODES = ("default", "lazy")
REPLICATION = ("none", "wiring", "all")

# Every key a definition may hold, in the order `validate` checks them. The
# order is part of the contract: it decides which problem is "the first".
DEFINITION_KEYS = (
    "ha-mode",
    "ha-params",
    "ha-sync-mode",
    "ha-promote-on-failure",
    "ha-promote-on-shutdown",
    "ha-min-synchronised",
    "message-ttl",
    "expires",
    "max-length",
    "max-length-bytes",
    "overflow",
    "dead-letter-exchange",
    "dead-letter-routing-key",
    "dead-letter-queue",
    "delivery-limit",
    "queue-mode",
    "replication",
)


@dataclass(frozen=True)
class Policy:
    """One policy of one vhost, as set by `set_policy`.

    `definition` is copied into a dict on construction and must be treated as
    read-only; it takes no part in hashing (a dict cannot), only in equality.
    A `Policy` may be invalid; `validate` says whether it is.
    """

    vhost: str
    name: str
    pattern: str
    definition: Mapping[str, Any] = field(hash=False)
    priority: int = 0
    apply_to: str = "queues"

    def __post_init__(self) -> None:
        # A private copy, so that a caller mutating its dict cannot change a
        # policy that was already validated or stored.
        if isinstance(self.definition, Mapping):
            object.__setattr__(self, "definition", dict(self.definition))


class PolicyError(ValueError):
    """A refused policy. `key` is the field or definition key at fault.

    `key` is one of "vhost", "name", "pattern", "priority", "apply-to",
    "definition" (the definition as a whole: empty, not an object, bad JSON) or
    a definition key. `str(error)` is the user-facing message, which names the
    key and says why.
    """

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def validate(policy: Policy) -> Policy:
    """Return a normalised copy of `policy`, or raise `PolicyError` for its first problem."""
    _check_label("vhost", policy.vhost)
    _check_label("name", policy.name)
    _check_pattern(policy.pattern)
    if not _is_int(policy.priority):
        _fail("priority", f"must be an integer, got {_show(policy.priority)}")
    if not MIN_PRIORITY <= policy.priority <= MAX_PRIORITY:
        _fail("priority", f"must be between {MIN_PRIORITY} and {MAX_PRIORITY}, got {policy.priority}")
    if policy.apply_to not in APPLY_TO:
        _fail("apply-to", f"must be one of {_choices(APPLY_TO)}, got {_show(policy.apply_to)}")
    definition = validate_definition(policy.definition)
    return Policy(
        vhost=policy.vhost,
        name=policy.name,
        pattern=policy.pattern,
        definition=definition,
        priority=policy.priority,
        apply_to=policy.apply_to,
    )


def validate_definition(definition: Mapping[str, Any]) -> dict[str, Any]:
    """Return a normalised copy of a policy definition, or raise `PolicyError` for its first problem."""
    if not isinstance(definition, Mapping):
        _fail("definition", f"must be an object of key/value pairs, got {_show(definition)}")
    if not definition:
        _fail("definition", "must not be empty")
    for key in definition:
        if not isinstance(key, str):
            _fail("definition", f"keys must be strings, got {_show(key)}")
    for key in sorted(definition):
        if key not in DEFINITION_KEYS:
            raise PolicyError(key, _unknown_key_message(key))
    for key in DEFINITION_KEYS:
        if key in definition:
            _KEY_CHECKS[key](definition)
    # Checks that concern a key which is absent (the missing ha-params).
    mode = definition.get("ha-mode")
    if mode in ("exactly", "nodes") and "ha-params" not in definition:
        what = "the total number of replicas" if mode == "exactly" else "the list of node names"
        _fail("ha-params", f"ha-mode {mode} needs ha-params ({what})")
    normalised = {key: definition[key] for key in sorted(definition)}
    if mode == "nodes":
        normalised["ha-params"] = list(definition["ha-params"])
    return normalised


def parse_definition(text: str) -> dict[str, Any]:
    """Parse a definition given as JSON object text (the CLI's DEFINITION argument).

    Only the syntax is checked here (JSON, an object, no repeated key); the keys
    and values are `validate`'s business.
    """
    try:
        value = json.loads(text, object_pairs_hook=_refuse_repeated_keys)
    except _RepeatedKeyError as error:
        raise PolicyError("definition", f'definition: key "{error.key}" appears more than once') from None
    except json.JSONDecodeError as error:
        raise PolicyError("definition", f"definition: not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise PolicyError("definition", f"definition: must be a JSON object, got {_json_kind(value)}")
    return value


def effective_policy(vhost: str, queue_name: str, policies: Iterable[Policy]) -> Policy | None:
    """The policy that applies to queue `queue_name` of `vhost`, or None.

    Candidates: the policies of that vhost whose apply_to is "queues" or "all"
    and whose pattern matches the queue name anywhere (RE2 search, as in
    RabbitMQ: users anchor with ^ and $ themselves). The candidate with the
    highest priority wins; on equal priority the greatest name wins (so "b"
    beats "a"), then the greatest pattern, apply-to and definition summary, so
    that the answer never depends on the order of `policies`. Patterns are
    assumed valid (the policies were validated when set).
    """
    best: Policy | None = None
    for policy in policies:
        if policy.vhost != vhost or policy.apply_to not in APPLY_TO:
            continue
        if compiled_pattern(policy.pattern).search(queue_name) is None:
            continue
        if best is None or _rank(policy) > _rank(best):
            best = policy
    return best


def min_synchronised(definition: Mapping[str, Any]) -> int:
    """How many synchronised mirrors a queue's master needs before it confirms anything.

    `ha-min-synchronised` if the definition sets it. Otherwise 1 when the
    definition asks for two or more replicas (ha-mode all; exactly with
    ha-params >= 2; nodes naming two or more distinct nodes) and replicates
    messages (replication "all", the default), so that a confirm never rests
    on one copy; else 0. `definition` is assumed validated.
    """
    floor = definition.get("ha-min-synchronised")
    if _is_int(floor):
        return floor
    if definition.get("replication", "all") != "all":
        return 0
    mode, params = definition.get("ha-mode"), definition.get("ha-params")
    if mode == "all":
        return 1
    if mode == "exactly":
        return 1 if _is_int(params) and params >= 2 else 0
    if mode == "nodes":
        return 1 if isinstance(params, list | tuple) and len(set(params)) >= 2 else 0
    return 0


def definition_summary(definition: Mapping[str, Any]) -> str:
    """One line for CLI tables: `key=value` pairs in key order, space separated.

    Lists are comma joined, booleans and null as in JSON, and strings printed
    bare unless they are empty or hold spaces, commas or quotes (then JSON
    quoted), e.g. `ha-mode=exactly ha-params=2 ha-sync-mode=automatic`.
    """
    return " ".join(f"{key}={_summary_value(definition[key])}" for key in sorted(definition))


# -- field checks --------------------------------------------------------------


def _check_label(key: str, value: object) -> None:
    if not isinstance(value, str):
        _fail(key, f"must be a string, got {_show(value)}")
    problem = name_problem(value)
    if problem is not None:
        _fail(key, problem)


def _check_pattern(pattern: object) -> None:
    if not isinstance(pattern, str):
        _fail("pattern", f"must be a string, got {_show(pattern)}")
    problem = pattern_problem(pattern)
    if problem is not None:
        _fail("pattern", problem)


def pattern_problem(pattern: str) -> str | None:
    """Why `pattern` cannot be matched against names (a policy's or a permission's), or None: its size is
    checked before anything is compiled, then RE2 must accept it."""
    size = len(pattern.encode())
    if size > MAX_PATTERN_BYTES:
        return f"must be at most {MAX_PATTERN_BYTES} bytes of UTF-8, got {size}"
    try:
        compiled_pattern(pattern)
    except re2.error as error:
        why = error.args[0].decode(errors="replace") if error.args and isinstance(error.args[0], bytes) else error
        return f"not a valid RE2 regular expression (no backreferences or lookaround): {why}"
    return None


@functools.lru_cache(maxsize=MAX_COMPILED_PATTERNS)
def compiled_pattern(pattern: str) -> Any:
    """`pattern` compiled by RE2, which matches in time linear in the name whatever the pattern (Python's
    `re` backtracks: `(a+)+$` took seconds on a 27-character name); re2.error if it is not valid."""
    return re2.compile(pattern, _RE2_OPTIONS)


# -- definition key checks (each receives the whole definition) ----------------


def _check_ha_mode(definition: Mapping[str, Any]) -> None:
    _check_choice(definition, "ha-mode", HA_MODES)


def _check_ha_params(definition: Mapping[str, Any]) -> None:
    params = definition["ha-params"]
    mode = definition.get("ha-mode")
    if mode is None:
        _fail("ha-params", "needs ha-mode (exactly or nodes)")
    if mode == "all":
        _fail("ha-params", "not allowed with ha-mode all (every node gets a replica)")
    if mode == "exactly":
        if not _is_int(params) or params < 1:
            _fail("ha-params", f"ha-mode exactly needs a positive integer, got {_show(params)}")
        return
    # mode == "nodes"
    if not isinstance(params, list | tuple) or not params:
        _fail("ha-params", f"ha-mode nodes needs a non-empty list of node names, got {_show(params)}")
    seen: set[str] = set()
    for node in params:
        if not isinstance(node, str) or not node:
            _fail("ha-params", f"ha-mode nodes needs non-empty node name strings, got {_show(node)}")
        if node in seen:
            _fail("ha-params", f"node {_show(node)} is listed more than once")
        seen.add(node)


def _needs_ha_mode(definition: Mapping[str, Any], key: str) -> None:
    if "ha-mode" not in definition:
        _fail(key, "needs ha-mode (it only applies to mirrored queues)")


def _check_ha_sync_mode(definition: Mapping[str, Any]) -> None:
    _check_choice(definition, "ha-sync-mode", HA_SYNC_MODES)
    _needs_ha_mode(definition, "ha-sync-mode")


def _check_ha_promote_on_failure(definition: Mapping[str, Any]) -> None:
    _check_choice(definition, "ha-promote-on-failure", HA_PROMOTE)
    _needs_ha_mode(definition, "ha-promote-on-failure")


def _check_ha_promote_on_shutdown(definition: Mapping[str, Any]) -> None:
    _check_choice(definition, "ha-promote-on-shutdown", HA_PROMOTE)
    _needs_ha_mode(definition, "ha-promote-on-shutdown")


def _check_ha_min_synchronised(definition: Mapping[str, Any]) -> None:
    key = "ha-min-synchronised"
    floor = definition[key]
    if not _is_int(floor) or floor < 0:
        _fail(key, f"must be an integer >= 0 (synchronised mirrors), got {_show(floor)}")
    _needs_ha_mode(definition, key)
    if floor > 0 and definition.get("replication") == "wiring":
        _fail(key, 'must be 0 with replication "wiring" (its mirrors hold no messages to be synchronised with)')
    most = _most_mirrors(definition)
    if most is not None and floor > most:
        mode, params = definition["ha-mode"], _show(definition["ha-params"])
        _fail(
            key,
            f"{floor} synchronised mirrors can never be reached: ha-mode {mode} with ha-params {params} "
            f"keeps at most {most} mirror{'' if most == 1 else 's'}",
        )


def _most_mirrors(definition: Mapping[str, Any]) -> int | None:
    """The most mirrors a queue can ever have under `definition` (None: no bound, or ha-params not valid yet)."""
    mode, params = definition.get("ha-mode"), definition.get("ha-params")
    if mode == "exactly" and _is_int(params):
        return params - 1
    if mode == "nodes" and isinstance(params, list | tuple):
        return len(params)  # distinct once validated; the master may be a node the list does not name
    return None


def _check_message_ttl(definition: Mapping[str, Any]) -> None:
    _check_int(definition, "message-ttl", 0, " (milliseconds)", maximum=MAX_TTL_MS)


def _check_expires(definition: Mapping[str, Any]) -> None:
    _check_int(definition, "expires", 1, " (milliseconds)", maximum=MAX_TTL_MS)


def _check_max_length(definition: Mapping[str, Any]) -> None:
    _check_int(definition, "max-length", 0, " (messages)")


def _check_max_length_bytes(definition: Mapping[str, Any]) -> None:
    _check_int(definition, "max-length-bytes", 0, " (bytes)")


def _check_overflow(definition: Mapping[str, Any]) -> None:
    _check_choice(definition, "overflow", OVERFLOW)


def _check_dead_letter_exchange(definition: Mapping[str, Any]) -> None:
    _check_string(definition, "dead-letter-exchange", allow_empty=True)


def _check_dead_letter_routing_key(definition: Mapping[str, Any]) -> None:
    _check_string(definition, "dead-letter-routing-key", allow_empty=True)
    if "dead-letter-exchange" not in definition:
        _fail("dead-letter-routing-key", "needs dead-letter-exchange")


def _check_dead_letter_queue(definition: Mapping[str, Any]) -> None:
    _check_string(definition, "dead-letter-queue", allow_empty=False)
    if "dead-letter-exchange" in definition:
        _fail("dead-letter-queue", "cannot be combined with dead-letter-exchange (choose one dead-letter target)")


def _check_delivery_limit(definition: Mapping[str, Any]) -> None:
    _check_int(definition, "delivery-limit", 0, "")


def _check_queue_mode(definition: Mapping[str, Any]) -> None:
    _check_choice(definition, "queue-mode", QUEUE_MODES)


def _check_replication(definition: Mapping[str, Any]) -> None:
    _check_choice(definition, "replication", REPLICATION)
    if definition["replication"] == "none":
        ha_keys = sorted(key for key in definition if key.startswith("ha-"))
        if ha_keys:
            _fail(
                "replication",
                f'"none" cannot be combined with {", ".join(ha_keys)} (a queue without replicas cannot be mirrored)',
            )


_KEY_CHECKS = {
    "ha-mode": _check_ha_mode,
    "ha-params": _check_ha_params,
    "ha-sync-mode": _check_ha_sync_mode,
    "ha-promote-on-failure": _check_ha_promote_on_failure,
    "ha-promote-on-shutdown": _check_ha_promote_on_shutdown,
    "ha-min-synchronised": _check_ha_min_synchronised,
    "message-ttl": _check_message_ttl,
    "expires": _check_expires,
    "max-length": _check_max_length,
    "max-length-bytes": _check_max_length_bytes,
    "overflow": _check_overflow,
    "dead-letter-exchange": _check_dead_letter_exchange,
    "dead-letter-routing-key": _check_dead_letter_routing_key,
    "dead-letter-queue": _check_dead_letter_queue,
    "delivery-limit": _check_delivery_limit,
    "queue-mode": _check_queue_mode,
    "replication": _check_replication,
}
assert tuple(_KEY_CHECKS) == DEFINITION_KEYS, "every definition key needs exactly one check"


# -- helpers -------------------------------------------------------------------


def _fail(key: str, why: str) -> NoReturn:
    raise PolicyError(key, f"{key}: {why}")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(definition: Mapping[str, Any], key: str, minimum: int, unit: str, *, maximum: int | None = None) -> None:
    value = definition[key]
    if not _is_int(value) or value < minimum:
        _fail(key, f"must be an integer >= {minimum}{unit}, got {_show(value)}")
    if maximum is not None and value > maximum:
        _fail(key, f"must be at most {maximum}{unit}, got {_show(value)}")


def _check_choice(definition: Mapping[str, Any], key: str, choices: tuple[str, ...]) -> None:
    value = definition[key]
    if not isinstance(value, str) or value not in choices:
        _fail(key, f"must be one of {_choices(choices)}, got {_show(value)}")


def _check_string(definition: Mapping[str, Any], key: str, *, allow_empty: bool) -> None:
    value = definition[key]
    if value == "" and allow_empty:
        return
    _check_label(key, value)


def _choices(choices: tuple[str, ...]) -> str:
    return ", ".join(f'"{choice}"' for choice in choices)


def _show(value: object) -> str:
    """A value as the user wrote it: JSON where possible (definitions are JSON)."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        return repr(value)


def _json_kind(value: object) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return "null"


def _unknown_key_message(key: str) -> str:
    close = difflib.get_close_matches(key.lower(), DEFINITION_KEYS, n=1)
    if close:
        return f'unknown key "{key}" (did you mean "{close[0]}"?)'
    return f'unknown key "{key}" (known keys: {", ".join(DEFINITION_KEYS)})'


class _RepeatedKeyError(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _refuse_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _RepeatedKeyError(key)
        result[key] = value
    return result


def _rank(policy: Policy) -> tuple[int, str, str, str, str]:
    return (policy.priority, policy.name, policy.pattern, policy.apply_to, definition_summary(policy.definition))


_BARE = re.compile(r"[^\s,\"']+")


def _summary_value(value: object) -> str:
    if isinstance(value, list | tuple):
        return ",".join(_summary_value(item) for item in value)
    if isinstance(value, str):
        return value if _BARE.fullmatch(value) else _show(value)
    return _show(value)
