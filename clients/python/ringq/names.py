"""The one rule for the names users give: vhosts, queues, policies (and later streams and users).

Responsible for: deciding whether a name is acceptable, with a message that says why not. The
services apply it to every request and record, `ringqctl` before it sends, and the README states it.
Guarantees: an accepted name is 1 to MAX_NAME_BYTES bytes of UTF-8 (an AMQP short string) made of
printable characters: no control or format characters, no line or paragraph separators, no
unassigned code points and no lone surrogates. The space and every other printable character,
"/" included (the default vhost is "/"), are allowed. Names are never used as file or directory
names: a node keeps a queue's files under a directory named by a digest it computes, so "..",
"a/b" or a name longer than the file system allows are ordinary names.
"""

from __future__ import annotations

import unicodedata

MAX_NAME_BYTES = 255
_REFUSED_CATEGORIES = {
    "Cc": "a control",
    "Cf": "a format",
    "Cs": "a surrogate",
    "Co": "a private-use",
    "Cn": "an unassigned",
    "Zl": "a line separator",
    "Zp": "a paragraph separator",
}


class InvalidName(ValueError):
    """A name that breaks the rule; the message names the field and the reason."""


def name_problem(value: object) -> str | None:
    """Why `value` is not an acceptable name, or None if it is."""
    if not isinstance(value, str):
        return f"must be a string, got {type(value).__name__}"
    if not value:
        return "must not be empty"
    for position, character in enumerate(value):
        category = unicodedata.category(character)
        if category in _REFUSED_CATEGORIES:
            return f"must not contain {_REFUSED_CATEGORIES[category]} character ({character!r} at {position})"
    size = len(value.encode())
    if size > MAX_NAME_BYTES:
        return f"must be at most {MAX_NAME_BYTES} bytes of UTF-8, got {size}"
    return None


def check_name(field: str, value: object) -> str:
    """`value` if it is an acceptable name; InvalidName naming `field` otherwise."""
    problem = name_problem(value)
    if problem is not None:
        raise InvalidName(f"{field} {problem}")
    assert isinstance(value, str)
    return value
