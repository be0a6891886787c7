"""Unit tests of queue arguments (services/coordinator/queue_arguments.py): validated like policies,
combined with the queue's policy as RabbitMQ combines them."""

from __future__ import annotations

import pytest

from services.coordinator.queue_arguments import (
    ArgumentError,
    effective_definition,
    single_active_consumer,
    validate,
)


def test_known_arguments_with_good_values_are_parsed() -> None:
    arguments = {
        "x-max-length": "10",
        "x-max-length-bytes": "1048576",
        "x-message-ttl": "60000",
        "x-delivery-limit": "3",
        "x-overflow": '"reject-publish"',
        "x-dead-letter-queue": '"dead"',
        "x-single-active-consumer": "true",
    }
    assert validate(arguments) == {
        "x-max-length": 10,
        "x-max-length-bytes": 1048576,
        "x-message-ttl": 60000,
        "x-delivery-limit": 3,
        "x-overflow": "reject-publish",
        "x-dead-letter-queue": "dead",
        "x-single-active-consumer": True,
    }
    assert validate({}) == {}


@pytest.mark.parametrize(
    ("arguments", "key", "says"),
    [
        ({"x-max-length": '"ten"'}, "x-max-length", 'must be an integer >= 0 (messages), got "ten"'),
        ({"x-max-length": "ten"}, "x-max-length", "must be JSON"),
        ({"x-max-length": "-1"}, "x-max-length", "must be an integer >= 0"),
        ({"x-max-length": "true"}, "x-max-length", "must be an integer"),
        ({"x-message-ttl": str(2**32)}, "x-message-ttl", "must be at most 4294967295"),
        ({"x-overflow": '"reject-publish-dlx"'}, "x-overflow", "must be one of"),
        ({"x-dead-letter-queue": '""'}, "x-dead-letter-queue", "dead-letter-queue"),
        ({"x-single-active-consumer": '"yes"'}, "x-single-active-consumer", "must be true or false"),
        ({"x-max-lenght": "10"}, "x-max-lenght", "unknown argument; known arguments are x-message-ttl"),
        ({"x-dead-letter-exchange": '"dlx"'}, "x-dead-letter-exchange", "unknown argument"),
        # The first at fault in sorted order is the one named.
        ({"x-overflow": "1", "x-max-length": "-1"}, "x-max-length", "must be an integer"),
    ],
)
def test_bad_arguments_are_refused_naming_the_argument(arguments: dict[str, str], key: str, says: str) -> None:
    with pytest.raises(ArgumentError) as refused:
        validate(arguments)
    assert refused.value.key == key
    assert str(refused.value).startswith(f"arguments[{key!r}]")
    assert says in str(refused.value)


def test_limits_take_the_lower_of_policy_and_argument_and_the_rest_the_argument() -> None:
    policy = {"ha-mode": "all", "max-length": 100, "max-length-bytes": 2**31, "overflow": "drop-head"}
    arguments = {"x-max-length": "10", "x-max-length-bytes": str(2**40), "x-overflow": '"reject-publish"'}
    assert effective_definition(policy, arguments) == {
        "ha-mode": "all",
        "max-length": 10,
        "max-length-bytes": 2**31,
        "overflow": "reject-publish",
    }
    assert policy["max-length"] == 100, "the policy given is never changed"
    assert effective_definition({}, {"x-message-ttl": "5"}) == {"message-ttl": 5}
    # Arguments stored before validation existed, and failing it now, count as absent.
    assert effective_definition({"max-length": 7}, {"x-max-length": '"ten"'}) == {"max-length": 7}
    assert single_active_consumer({"x-single-active-consumer": "true"})
    assert not single_active_consumer({"x-single-active-consumer": '"true"'})
    assert not single_active_consumer({})
