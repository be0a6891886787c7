"""Unit tests of the pure policy rules (services.coordinator.policies)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from services.coordinator.policies import (
    Policy,
    PolicyError,
    compiled_pattern,
    definition_summary,
    effective_policy,
    min_synchronised,
    parse_definition,
    validate,
)

HA_TWO = {"ha-mode": "exactly", "ha-params": 2, "ha-sync-mode": "automatic"}


def policy(definition: dict[Any, Any] | None = None, **fields: Any) -> Policy:
    arguments: dict[str, Any] = {"vhost": "/", "name": "ha-two", "pattern": "^ha\\.", "definition": HA_TWO}
    if definition is not None:
        arguments["definition"] = definition
    arguments.update(fields)
    return Policy(**arguments)


def refusal(candidate: Policy) -> PolicyError:
    with pytest.raises(PolicyError) as caught:
        validate(candidate)
    return caught.value


RE2_REFUSAL = "pattern: not a valid RE2 regular expression (no backreferences or lookaround): "


# -- refused fields ------------------------------------------------------------

REFUSED_FIELDS: list[tuple[dict[str, Any], str, str]] = [
    ({"vhost": ""}, "vhost", "vhost: must not be empty"),
    ({"vhost": 7}, "vhost", "vhost: must be a string, got 7"),
    ({"vhost": "a\x00b"}, "vhost", "vhost: must not contain a control character ('\\x00' at 1)"),
    ({"name": ""}, "name", "name: must not be empty"),
    ({"name": "x" * 256}, "name", "name: must be at most 255 bytes of UTF-8, got 256"),
    ({"name": "two\nlines"}, "name", "name: must not contain a control character ('\\n' at 3)"),
    ({"pattern": "("}, "pattern", f"{RE2_REFUSAL}missing ): ("),
    ({"pattern": "[a-"}, "pattern", f"{RE2_REFUSAL}missing ]: [a-"),
    ({"pattern": "(a)\\1"}, "pattern", f"{RE2_REFUSAL}invalid escape sequence: \\1"),  # a backreference
    ({"pattern": "(?=a)"}, "pattern", f"{RE2_REFUSAL}invalid perl operator: (?="),  # lookahead
    ({"pattern": "a" * 4097}, "pattern", "pattern: must be at most 4096 bytes of UTF-8, got 4097"),
    ({"pattern": None}, "pattern", "pattern: must be a string, got null"),
    ({"priority": True}, "priority", "priority: must be an integer, got true"),
    ({"priority": "5"}, "priority", 'priority: must be an integer, got "5"'),
    ({"priority": 1.0}, "priority", "priority: must be an integer, got 1.0"),
    ({"priority": 2**31}, "priority", "priority: must be between -2147483648 and 2147483647, got 2147483648"),
    ({"priority": -(2**31) - 1}, "priority", "priority: must be between -2147483648 and 2147483647, got -2147483649"),
    ({"apply_to": "exchanges"}, "apply-to", 'apply-to: must be one of "all", "queues", got "exchanges"'),
    ({"apply_to": "Queues"}, "apply-to", 'apply-to: must be one of "all", "queues", got "Queues"'),
]


@pytest.mark.parametrize(("fields", "key", "message"), REFUSED_FIELDS)
def test_refused_fields(fields: dict[str, Any], key: str, message: str) -> None:
    error = refusal(policy(**fields))
    assert (error.key, str(error)) == (key, message)


# -- refused definitions -------------------------------------------------------

REFUSED_DEFINITIONS: list[tuple[dict[Any, Any], str, str]] = [
    # the definition as a whole
    ({}, "definition", "definition: must not be empty"),
    ({1: "all"}, "definition", "definition: keys must be strings, got 1"),
    # unknown keys, with a suggestion when one is close
    ({"ha-mod": "all"}, "ha-mod", 'unknown key "ha-mod" (did you mean "ha-mode"?)'),
    ({"Ha-Mode": "all"}, "Ha-Mode", 'unknown key "Ha-Mode" (did you mean "ha-mode"?)'),
    ({"ha-mode": "all", "max-lenght": 5}, "max-lenght", 'unknown key "max-lenght" (did you mean "max-length"?)'),
    (
        {"colour": "red"},
        "colour",
        'unknown key "colour" (known keys: ha-mode, ha-params, ha-sync-mode, ha-promote-on-failure, '
        "ha-promote-on-shutdown, ha-min-synchronised, message-ttl, expires, max-length, max-length-bytes, overflow, "
        "dead-letter-exchange, dead-letter-routing-key, dead-letter-queue, delivery-limit, queue-mode, "
        "replication)",
    ),
    # ha-mode
    ({"ha-mode": "two"}, "ha-mode", 'ha-mode: must be one of "all", "exactly", "nodes", got "two"'),
    ({"ha-mode": "All"}, "ha-mode", 'ha-mode: must be one of "all", "exactly", "nodes", got "All"'),
    ({"ha-mode": 2}, "ha-mode", 'ha-mode: must be one of "all", "exactly", "nodes", got 2'),
    # ha-params for exactly
    (
        {"ha-mode": "exactly", "ha-params": "two"},
        "ha-params",
        'ha-params: ha-mode exactly needs a positive integer, got "two"',
    ),
    ({"ha-mode": "exactly", "ha-params": 0}, "ha-params", "ha-params: ha-mode exactly needs a positive integer, got 0"),
    (
        {"ha-mode": "exactly", "ha-params": -2},
        "ha-params",
        "ha-params: ha-mode exactly needs a positive integer, got -2",
    ),
    (
        {"ha-mode": "exactly", "ha-params": True},
        "ha-params",
        "ha-params: ha-mode exactly needs a positive integer, got true",
    ),
    (
        {"ha-mode": "exactly", "ha-params": 2.0},
        "ha-params",
        "ha-params: ha-mode exactly needs a positive integer, got 2.0",
    ),
    (
        {"ha-mode": "exactly", "ha-params": ["n1"]},
        "ha-params",
        'ha-params: ha-mode exactly needs a positive integer, got ["n1"]',
    ),
    # ha-params for nodes
    (
        {"ha-mode": "nodes", "ha-params": []},
        "ha-params",
        "ha-params: ha-mode nodes needs a non-empty list of node names, got []",
    ),
    (
        {"ha-mode": "nodes", "ha-params": "n1"},
        "ha-params",
        'ha-params: ha-mode nodes needs a non-empty list of node names, got "n1"',
    ),
    (
        {"ha-mode": "nodes", "ha-params": 2},
        "ha-params",
        "ha-params: ha-mode nodes needs a non-empty list of node names, got 2",
    ),
    (
        {"ha-mode": "nodes", "ha-params": ["n1", ""]},
        "ha-params",
        'ha-params: ha-mode nodes needs non-empty node name strings, got ""',
    ),
    (
        {"ha-mode": "nodes", "ha-params": ["n1", 2]},
        "ha-params",
        "ha-params: ha-mode nodes needs non-empty node name strings, got 2",
    ),
    (
        {"ha-mode": "nodes", "ha-params": ["n1", "n2", "n1"]},
        "ha-params",
        'ha-params: node "n1" is listed more than once',
    ),
    # ha-params forbidden with all or without ha-mode, required with exactly and nodes
    (
        {"ha-mode": "all", "ha-params": 2},
        "ha-params",
        "ha-params: not allowed with ha-mode all (every node gets a replica)",
    ),
    ({"ha-params": 2}, "ha-params", "ha-params: needs ha-mode (exactly or nodes)"),
    ({"ha-mode": "exactly"}, "ha-params", "ha-params: ha-mode exactly needs ha-params (the total number of replicas)"),
    ({"ha-mode": "nodes"}, "ha-params", "ha-params: ha-mode nodes needs ha-params (the list of node names)"),
    # ha-sync-mode, ha-promote-*
    (
        {"ha-mode": "all", "ha-sync-mode": "manually"},
        "ha-sync-mode",
        'ha-sync-mode: must be one of "automatic", "manual", got "manually"',
    ),
    ({"ha-sync-mode": "manual"}, "ha-sync-mode", "ha-sync-mode: needs ha-mode (it only applies to mirrored queues)"),
    (
        {"ha-mode": "all", "ha-promote-on-failure": "sometimes"},
        "ha-promote-on-failure",
        'ha-promote-on-failure: must be one of "always", "when-synced", got "sometimes"',
    ),
    (
        {"ha-promote-on-failure": "always"},
        "ha-promote-on-failure",
        "ha-promote-on-failure: needs ha-mode (it only applies to mirrored queues)",
    ),
    (
        {"ha-mode": "all", "ha-promote-on-shutdown": True},
        "ha-promote-on-shutdown",
        'ha-promote-on-shutdown: must be one of "always", "when-synced", got true',
    ),
    (
        {"ha-promote-on-shutdown": "when-synced"},
        "ha-promote-on-shutdown",
        "ha-promote-on-shutdown: needs ha-mode (it only applies to mirrored queues)",
    ),
    # ha-min-synchronised: a non-negative integer, for a mirrored queue, within what the definition can give
    (
        {"ha-mode": "all", "ha-min-synchronised": -1},
        "ha-min-synchronised",
        "ha-min-synchronised: must be an integer >= 0 (synchronised mirrors), got -1",
    ),
    (
        {"ha-mode": "all", "ha-min-synchronised": True},
        "ha-min-synchronised",
        "ha-min-synchronised: must be an integer >= 0 (synchronised mirrors), got true",
    ),
    (
        {"ha-mode": "all", "ha-min-synchronised": 1.0},
        "ha-min-synchronised",
        "ha-min-synchronised: must be an integer >= 0 (synchronised mirrors), got 1.0",
    ),
    (
        {"ha-mode": "all", "ha-min-synchronised": "1"},
        "ha-min-synchronised",
        'ha-min-synchronised: must be an integer >= 0 (synchronised mirrors), got "1"',
    ),
    (
        {"ha-min-synchronised": 1},
        "ha-min-synchronised",
        "ha-min-synchronised: needs ha-mode (it only applies to mirrored queues)",
    ),
    (
        {"ha-mode": "exactly", "ha-params": 2, "ha-min-synchronised": 2},
        "ha-min-synchronised",
        "ha-min-synchronised: 2 synchronised mirrors can never be reached: "
        "ha-mode exactly with ha-params 2 keeps at most 1 mirror",
    ),
    (
        {"ha-mode": "nodes", "ha-params": ["n1", "n2"], "ha-min-synchronised": 3},
        "ha-min-synchronised",
        "ha-min-synchronised: 3 synchronised mirrors can never be reached: "
        'ha-mode nodes with ha-params ["n1", "n2"] keeps at most 2 mirrors',
    ),
    (
        {"ha-mode": "all", "replication": "wiring", "ha-min-synchronised": 1},
        "ha-min-synchronised",
        'ha-min-synchronised: must be 0 with replication "wiring" '
        "(its mirrors hold no messages to be synchronised with)",
    ),
    (
        {"replication": "none", "ha-min-synchronised": 0},
        "ha-min-synchronised",
        "ha-min-synchronised: needs ha-mode (it only applies to mirrored queues)",
    ),
    # integer limits (bool and float are never integers)
    ({"message-ttl": -1}, "message-ttl", "message-ttl: must be an integer >= 0 (milliseconds), got -1"),
    ({"message-ttl": "1000"}, "message-ttl", 'message-ttl: must be an integer >= 0 (milliseconds), got "1000"'),
    ({"message-ttl": True}, "message-ttl", "message-ttl: must be an integer >= 0 (milliseconds), got true"),
    ({"message-ttl": 1.5}, "message-ttl", "message-ttl: must be an integer >= 0 (milliseconds), got 1.5"),
    (
        {"message-ttl": 2**32},
        "message-ttl",
        "message-ttl: must be at most 4294967295 (milliseconds), got 4294967296",
    ),
    ({"expires": 2**64 - 1}, "expires", f"expires: must be at most 4294967295 (milliseconds), got {2**64 - 1}"),
    ({"expires": 0}, "expires", "expires: must be an integer >= 1 (milliseconds), got 0"),
    ({"expires": False}, "expires", "expires: must be an integer >= 1 (milliseconds), got false"),
    ({"max-length": -1}, "max-length", "max-length: must be an integer >= 0 (messages), got -1"),
    ({"max-length": None}, "max-length", "max-length: must be an integer >= 0 (messages), got null"),
    ({"max-length-bytes": -5}, "max-length-bytes", "max-length-bytes: must be an integer >= 0 (bytes), got -5"),
    ({"max-length-bytes": "1MB"}, "max-length-bytes", 'max-length-bytes: must be an integer >= 0 (bytes), got "1MB"'),
    ({"delivery-limit": -1}, "delivery-limit", "delivery-limit: must be an integer >= 0, got -1"),
    ({"delivery-limit": True}, "delivery-limit", "delivery-limit: must be an integer >= 0, got true"),
    # overflow, queue-mode, replication
    (
        {"overflow": "reject-publish-dlx"},
        "overflow",
        'overflow: must be one of "drop-head", "reject-publish", got "reject-publish-dlx"',
    ),
    ({"queue-mode": "fast"}, "queue-mode", 'queue-mode: must be one of "default", "lazy", got "fast"'),
    ({"replication": "some"}, "replication", 'replication: must be one of "none", "wiring", "all", got "some"'),
    (
        {"replication": "none", "ha-mode": "all"},
        "replication",
        'replication: "none" cannot be combined with ha-mode (a queue without replicas cannot be mirrored)',
    ),
    (
        {"replication": "none", "ha-mode": "exactly", "ha-params": 2, "ha-sync-mode": "manual"},
        "replication",
        'replication: "none" cannot be combined with ha-mode, ha-params, ha-sync-mode '
        "(a queue without replicas cannot be mirrored)",
    ),
    # dead-letter target
    ({"dead-letter-exchange": 5}, "dead-letter-exchange", "dead-letter-exchange: must be a string, got 5"),
    (
        {"dead-letter-exchange": "x" * 256},
        "dead-letter-exchange",
        "dead-letter-exchange: must be at most 255 bytes of UTF-8, got 256",
    ),
    (
        {"dead-letter-routing-key": "dead"},
        "dead-letter-routing-key",
        "dead-letter-routing-key: needs dead-letter-exchange",
    ),
    (
        {"dead-letter-queue": "dlq", "dead-letter-routing-key": "dead"},
        "dead-letter-routing-key",
        "dead-letter-routing-key: needs dead-letter-exchange",
    ),
    (
        {"dead-letter-exchange": "dlx", "dead-letter-routing-key": ["a"]},
        "dead-letter-routing-key",
        'dead-letter-routing-key: must be a string, got ["a"]',
    ),
    ({"dead-letter-queue": ""}, "dead-letter-queue", "dead-letter-queue: must not be empty"),
    ({"dead-letter-queue": 1}, "dead-letter-queue", "dead-letter-queue: must be a string, got 1"),
    (
        {"dead-letter-exchange": "dlx", "dead-letter-queue": "dlq"},
        "dead-letter-queue",
        "dead-letter-queue: cannot be combined with dead-letter-exchange (choose one dead-letter target)",
    ),
    # the FIRST problem is reported: unknown keys before values, then DEFINITION_KEYS order
    (
        {"ha-mode": "bogus", "message-ttl": -1, "mesage-ttl": 1},
        "mesage-ttl",
        'unknown key "mesage-ttl" (did you mean "message-ttl"?)',
    ),
    (
        {"message-ttl": -1, "ha-mode": "bogus"},
        "ha-mode",
        'ha-mode: must be one of "all", "exactly", "nodes", got "bogus"',
    ),
    ({"queue-mode": "fast", "max-length": -1}, "max-length", "max-length: must be an integer >= 0 (messages), got -1"),
]


@pytest.mark.parametrize(("definition", "key", "message"), REFUSED_DEFINITIONS)
def test_refused_definitions(definition: dict[Any, Any], key: str, message: str) -> None:
    error = refusal(policy(definition))
    assert (error.key, str(error)) == (key, message)


def test_fields_are_checked_before_the_definition() -> None:
    error = refusal(policy({"ha-mod": "all"}, name="", pattern="("))
    assert error.key == "name"


def test_policy_error_is_a_value_error() -> None:
    assert issubclass(PolicyError, ValueError)


# -- accepted definitions and normalisation ------------------------------------

ACCEPTED: list[dict[str, Any]] = [
    {"ha-mode": "all"},
    {"ha-mode": "all", "ha-sync-mode": "manual", "ha-promote-on-failure": "always"},
    {"ha-mode": "exactly", "ha-params": 1},
    {"ha-mode": "exactly", "ha-params": 7, "ha-promote-on-shutdown": "when-synced"},
    {"ha-mode": "nodes", "ha-params": ["n1"]},
    {"ha-mode": "nodes", "ha-params": ["n3", "n1", "n2"], "ha-sync-mode": "automatic"},
    {"message-ttl": 0, "expires": 1, "max-length": 0, "max-length-bytes": 0, "delivery-limit": 0},
    {"message-ttl": 60_000, "max-length": 10_000, "overflow": "reject-publish", "queue-mode": "lazy"},
    {"overflow": "drop-head", "queue-mode": "default"},
    {"dead-letter-exchange": ""},  # the default exchange, as in RabbitMQ
    {"dead-letter-exchange": "dlx", "dead-letter-routing-key": ""},
    {"dead-letter-queue": "dead.letters", "delivery-limit": 3},
    {"replication": "none", "max-length": 5},
    {"replication": "wiring", "ha-mode": "all"},
    {"replication": "all", "ha-mode": "exactly", "ha-params": 2},
    {"ha-mode": "all", "ha-min-synchronised": 0},
    {"ha-mode": "all", "ha-min-synchronised": 4},  # more than the cluster has is the cluster's business
    {"ha-mode": "exactly", "ha-params": 3, "ha-min-synchronised": 2},
    {"ha-mode": "exactly", "ha-params": 1, "ha-min-synchronised": 0},
    {"ha-mode": "nodes", "ha-params": ["n1"], "ha-min-synchronised": 1},  # the master may be elsewhere
    {"ha-mode": "all", "replication": "wiring", "ha-min-synchronised": 0},
]


@pytest.mark.parametrize("definition", ACCEPTED)
def test_accepted_definitions(definition: dict[str, Any]) -> None:
    valid = validate(policy(definition))
    assert valid.definition == definition
    assert validate(valid) == valid  # idempotent


@pytest.mark.parametrize("priority", [-(2**31), -1, 0, 10, 2**31 - 1])
def test_priority_range_is_inclusive(priority: int) -> None:
    assert validate(policy(priority=priority)).priority == priority


@pytest.mark.parametrize(
    ("fields"),
    [
        {"vhost": "v" * 255, "name": "n" * 255},
        {"name": "ha all queues"},  # spaces are printable
        {"name": "ünïcode-名前"},
        {"pattern": ""},  # matches every queue, as in RabbitMQ
        {"apply_to": "all"},
    ],
)
def test_accepted_fields(fields: dict[str, Any]) -> None:
    assert validate(policy(**fields)) == policy(**fields)


def test_normalisation_sorts_keys_and_copies() -> None:
    written = {"ha-sync-mode": "automatic", "ha-params": ("n2", "n1"), "ha-mode": "nodes"}
    original = policy(written, priority=3, apply_to="all")
    valid = validate(original)
    assert list(valid.definition) == ["ha-mode", "ha-params", "ha-sync-mode"]
    assert valid.definition["ha-params"] == ["n2", "n1"]  # node order kept, tuple made a list
    assert valid.definition is not original.definition
    assert (valid.vhost, valid.name, valid.pattern, valid.priority, valid.apply_to) == (
        "/",
        "ha-two",
        "^ha\\.",
        3,
        "all",
    )
    assert written["ha-params"] == ("n2", "n1")  # the caller's value is untouched
    assert validate(valid) == valid


def test_policy_keeps_a_private_copy_of_its_definition() -> None:
    written: dict[str, Any] = {"ha-mode": "all"}
    kept = policy(written)
    written["ha-params"] = 2
    assert kept.definition == {"ha-mode": "all"}
    assert validate(kept).definition == {"ha-mode": "all"}


def test_policies_are_hashable_and_compare_by_value() -> None:
    assert policy({"ha-mode": "all"}) == policy({"ha-mode": "all"})
    assert policy({"ha-mode": "all"}) != policy({"max-length": 1})
    assert len({policy({"ha-mode": "all"}), policy({"ha-mode": "all"})}) == 1


# -- parse_definition ----------------------------------------------------------


def test_parse_definition_reads_a_json_object() -> None:
    text = '{"ha-mode": "exactly", "ha-params": 2, "ha-sync-mode": "automatic"}'
    assert parse_definition(text) == HA_TWO
    assert parse_definition('{"ha-mode": "nodes", "ha-params": ["n1", "n2"]}')["ha-params"] == ["n1", "n2"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1, 2]", "definition: must be a JSON object, got an array"),
        ('"ha-mode"', "definition: must be a JSON object, got a string"),
        ("3", "definition: must be a JSON object, got a number"),
        ("true", "definition: must be a JSON object, got a boolean"),
        ("null", "definition: must be a JSON object, got null"),
        ('{"ha-mode": "all", "ha-mode": "exactly"}', 'definition: key "ha-mode" appears more than once'),
    ],
)
def test_parse_definition_refuses_non_objects(text: str, message: str) -> None:
    with pytest.raises(PolicyError) as caught:
        parse_definition(text)
    assert (caught.value.key, str(caught.value)) == ("definition", message)


@pytest.mark.parametrize("text", ["", "{", "{'ha-mode': 'all'}", '{"ha-mode": all}', '{"a": 1} x'])
def test_parse_definition_refuses_bad_json(text: str) -> None:
    with pytest.raises(PolicyError) as caught:
        parse_definition(text)
    assert caught.value.key == "definition"
    assert str(caught.value).startswith("definition: not valid JSON: ")
    assert "line 1 column" in str(caught.value)  # the decoder says where


def test_parse_then_validate_names_the_bad_key() -> None:
    error = refusal(policy(parse_definition('{"ha-mode": "exactly", "ha-params": "two"}')))
    assert (error.key, str(error)) == ("ha-params", 'ha-params: ha-mode exactly needs a positive integer, got "two"')


# -- effective_policy ----------------------------------------------------------


def named(name: str, pattern: str, priority: int = 0, *, vhost: str = "/", apply_to: str = "queues") -> Policy:
    return Policy(vhost, name, pattern, {"ha-mode": "all"}, priority, apply_to)


def test_no_policy_matches() -> None:
    assert effective_policy("/", "orders", []) is None
    assert effective_policy("/", "orders", [named("ha", "^ha\\.")]) is None


def test_higher_priority_wins_whatever_the_order() -> None:
    low, high = named("a-low", "^ha", 1), named("b-high", "^ha\\.", 5)
    assert effective_policy("/", "ha.orders", [low, high]) is high
    assert effective_policy("/", "ha.orders", [high, low]) is high
    negative = named("z", ".*", -1)
    assert effective_policy("/", "ha.orders", [negative, named("a", "", 0)]) == named("a", "", 0)


@pytest.mark.parametrize("order", [0, 1])
def test_equal_priority_goes_to_the_greatest_name(order: int) -> None:
    first, second = named("alpha", "^q", 3), named("beta", "q$", 3)
    candidates = [first, second] if order == 0 else [second, first]
    assert effective_policy("/", "q", candidates) is second


def test_vhosts_are_isolated() -> None:
    other = named("other", ".*", 100, vhost="other")
    mine = named("mine", ".*", 0, vhost="/")
    assert effective_policy("/", "q", [other, mine]) is mine
    assert effective_policy("other", "q", [other, mine]) is other
    assert effective_policy("third", "q", [other, mine]) is None


def test_apply_to_filtering() -> None:
    exchanges = named("exchanges-only", ".*", 10, apply_to="exchanges")
    everything = named("everything", ".*", 1, apply_to="all")
    queues = named("queues", ".*", 0, apply_to="queues")
    assert effective_policy("/", "q", [exchanges, everything, queues]) is everything
    assert effective_policy("/", "q", [exchanges, queues]) is queues
    assert effective_policy("/", "q", [exchanges]) is None


@pytest.mark.parametrize(
    ("pattern", "queue", "matches"),
    [
        ("ha", "my-ha-queue", True),  # re.search: anywhere in the name
        ("^ha", "my-ha-queue", False),  # users anchor themselves
        ("^ha", "ha-queue", True),
        ("queue$", "ha-queue", True),
        ("^ha$", "ha-queue", False),
        ("", "anything", True),
        ("^(orders|invoices)\\.", "invoices.eu", True),
        ("HA", "ha-queue", False),  # case-sensitive
    ],
)
def test_patterns_use_search_semantics(pattern: str, queue: str, matches: bool) -> None:
    candidate = named("p", pattern)
    assert (effective_policy("/", queue, [candidate]) is candidate) is matches


def test_non_matching_policy_never_wins_on_priority() -> None:
    high = named("high", "^other", 99)
    low = named("low", "^q", 0)
    assert effective_policy("/", "q1", [high, low]) is low


# -- definition_summary --------------------------------------------------------


@pytest.mark.parametrize(
    ("definition", "summary"),
    [
        (
            {"ha-sync-mode": "automatic", "ha-params": 2, "ha-mode": "exactly"},
            "ha-mode=exactly ha-params=2 ha-sync-mode=automatic",
        ),
        ({"ha-mode": "nodes", "ha-params": ["n1", "n2"]}, "ha-mode=nodes ha-params=n1,n2"),
        ({"max-length": 0, "overflow": "reject-publish"}, "max-length=0 overflow=reject-publish"),
        ({"dead-letter-exchange": ""}, 'dead-letter-exchange=""'),
        ({"dead-letter-queue": "dead letters"}, 'dead-letter-queue="dead letters"'),
        ({"flag": True, "nothing": None}, "flag=true nothing=null"),
        ({}, ""),
    ],
)
def test_definition_summary(definition: dict[str, Any], summary: str) -> None:
    assert definition_summary(definition) == summary


# -- the floor of synchronised mirrors -------------------------------------------


@pytest.mark.parametrize(
    ("definition", "floor"),
    [
        # set: the value, whatever the definition would give by default
        ({"ha-mode": "all", "ha-min-synchronised": 0}, 0),
        ({"ha-mode": "all", "ha-min-synchronised": 2}, 2),
        ({"ha-mode": "exactly", "ha-params": 1, "ha-min-synchronised": 0}, 0),
        ({"ha-mode": "nodes", "ha-params": ["n1"], "ha-min-synchronised": 1}, 1),
        # unset: 1 when two or more replicas are asked for and messages are replicated
        ({"ha-mode": "all"}, 1),
        ({"ha-mode": "all", "replication": "all"}, 1),
        ({"ha-mode": "exactly", "ha-params": 2}, 1),
        ({"ha-mode": "exactly", "ha-params": 5}, 1),
        ({"ha-mode": "nodes", "ha-params": ["n1", "n2"]}, 1),
        # ... else 0
        ({"ha-mode": "exactly", "ha-params": 1}, 0),
        ({"ha-mode": "nodes", "ha-params": ["n1"]}, 0),
        ({"ha-mode": "all", "replication": "wiring"}, 0),
        ({"replication": "none"}, 0),
        ({"max-length": 10}, 0),
        ({}, 0),
    ],
)
def test_min_synchronised(definition: dict[str, Any], floor: int) -> None:
    assert min_synchronised(definition) == floor
    if definition:
        assert min_synchronised(validate(policy(definition)).definition) == floor, "validated definitions agree"


def test_min_synchronised_counts_distinct_nodes() -> None:
    """Validation refuses a node listed twice, but the rule itself never counts one node as two replicas."""
    assert min_synchronised({"ha-mode": "nodes", "ha-params": ["n1", "n1"]}) == 0


def test_a_backtracking_pattern_matches_in_linear_time() -> None:
    """Found by review: with Python's `re`, `(a+)+$` took 4.7 s on a 27-character queue name (growing
    fourfold per two characters) and froze every coordinator call meanwhile."""
    policy = validate(named("evil", "(a+)+$", 0))
    started = time.monotonic()
    for length in (27, 40, 255):
        assert effective_policy("/", "a" * length + "b", [policy]) is None
        assert effective_policy("/", "a" * length, [policy]) == policy
    assert time.monotonic() - started < 0.5


def test_many_policies_are_compiled_once_each() -> None:
    many = [validate(named(f"p{i}", f"^q{i}$", 0)) for i in range(2000)]
    compiled_pattern.cache_clear()
    for _ in range(3):
        for i in range(0, 2000, 7):
            assert effective_policy("/", f"q{i}", many) == many[i]
    assert compiled_pattern.cache_info().currsize == 2000 and compiled_pattern.cache_info().misses == 2000
