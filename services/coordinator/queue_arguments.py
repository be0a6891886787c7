"""Queue arguments (`x-...` at declare): validation, and how they combine with the queue's policy (pure).

Responsible for: the one rule for the arguments a client may give when it declares a queue, in
RabbitMQ's manner, checked with the same checks as a policy's definition (services/coordinator/
policies.py), and the limits a queue applies once its policy and its arguments are both known.

    argument                    policy key          when both say
    x-message-ttl               message-ttl         the lower wins
    x-max-length                max-length          the lower wins
    x-max-length-bytes          max-length-bytes    the lower wins
    x-delivery-limit            delivery-limit      the lower wins
    x-overflow                  overflow            the argument wins
    x-dead-letter-queue         dead-letter-queue   the argument wins
    x-single-active-consumer    (argument only: true or false)

Values are JSON texts (`"x-max-length": "10"`). Guarantees: `validate` accepts exactly the arguments
above with values a policy would accept, or raises ArgumentError naming the first argument at fault
(keys in sorted order) and why; `effective_definition` never fails (arguments stored before this
validation existed and do not pass it count as absent) and never changes the policy it is given.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from services.coordinator.policies import PolicyError, validate_definition

POLICY_KEYS = {
    "x-message-ttl": "message-ttl",
    "x-max-length": "max-length",
    "x-max-length-bytes": "max-length-bytes",
    "x-delivery-limit": "delivery-limit",
    "x-overflow": "overflow",
    "x-dead-letter-queue": "dead-letter-queue",
}
SINGLE_ACTIVE_CONSUMER = "x-single-active-consumer"
ARGUMENTS = (*POLICY_KEYS, SINGLE_ACTIVE_CONSUMER)
_LOWER_WINS = frozenset({"message-ttl", "max-length", "max-length-bytes", "delivery-limit"})


class ArgumentError(ValueError):
    """A refused queue argument; `key` is the argument, `str(error)` says why (for INVALID_ARGUMENT)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def validate(arguments: Mapping[str, str]) -> dict[str, Any]:
    """The arguments' values, parsed, or ArgumentError for the first one at fault."""
    parsed: dict[str, Any] = {}
    for key in sorted(arguments):
        if key not in ARGUMENTS:
            raise ArgumentError(
                key, f"arguments[{key!r}]: unknown argument; known arguments are {', '.join(ARGUMENTS)}"
            )
        try:
            parsed[key] = json.loads(arguments[key])
        except ValueError:
            raise ArgumentError(key, f"arguments[{key!r}] must be JSON, got {arguments[key]!r}") from None
    flag = parsed.get(SINGLE_ACTIVE_CONSUMER, False)
    if not isinstance(flag, bool):
        raise ArgumentError(SINGLE_ACTIVE_CONSUMER, f"arguments[{SINGLE_ACTIVE_CONSUMER!r}] must be true or false")
    as_policy = {POLICY_KEYS[key]: value for key, value in parsed.items() if key in POLICY_KEYS}
    if as_policy:
        try:
            validate_definition(as_policy)
        except PolicyError as error:
            argument = next((k for k, v in POLICY_KEYS.items() if v == error.key), error.key)
            why = str(error).removeprefix(f"{error.key}: ")
            raise ArgumentError(argument, f"arguments[{argument!r}]: {why}") from None
    return parsed


def single_active_consumer(arguments: Mapping[str, str]) -> bool:
    """Whether the arguments ask for a single active consumer (False if they do not pass `validate`)."""
    try:
        return bool(validate(arguments).get(SINGLE_ACTIVE_CONSUMER, False))
    except ArgumentError:
        return False


def effective_definition(policy_definition: Mapping[str, Any], arguments: Mapping[str, str]) -> dict[str, Any]:
    """The policy definition with the arguments' limits applied (the table above)."""
    try:
        parsed = validate(arguments)
    except ArgumentError:
        parsed = {}
    effective = dict(policy_definition)
    for argument, key in POLICY_KEYS.items():
        if argument not in parsed:
            continue
        value = parsed[argument]
        if key in _LOWER_WINS and key in effective:
            effective[key] = min(effective[key], value)
        else:
            effective[key] = value
    return effective
