"""Fragmentation of large ring messages on a link.

Responsible for: cutting a serialized RingMessage larger than
`MAX_FRAGMENT_BYTES` into numbered fragments, and putting them back together
within a memory budget shared by every link of a node.
Guarantees: the reassembled bytes equal the original; fragments of one message
travel consecutively on one link (FIFO), so a receiver holds at most one
partial message per link; the partial messages of all links together never
hold more than their `ReassemblyBudget`; malformed or oversized input, or a
fragment the budget cannot take, is refused with `FragmentError`, never
half-delivered (the link carrying it is then closed: see links.py).
"""

from __future__ import annotations

from ringq.internal.v1 import peer_pb2

MAX_FRAGMENT_BYTES = 64 * 1024
# A bound on one reassembled message (a Catchup may carry many pending publications of up to 16 MiB).
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# The default bound on the partial messages of all of a node's links together.
DEFAULT_REASSEMBLY_BUDGET_BYTES = 512 * 1024 * 1024


class ReassemblyBudget:
    """The bytes a node's links may hold in partial messages, all links together."""

    def __init__(self, limit_bytes: int = DEFAULT_REASSEMBLY_BUDGET_BYTES) -> None:
        self.limit_bytes = limit_bytes
        self.held_bytes = 0

    def take(self, size: int) -> bool:
        if self.held_bytes + size > self.limit_bytes:
            return False
        self.held_bytes += size
        return True

    def give_back(self, size: int) -> None:
        self.held_bytes -= size


class FragmentError(ValueError):
    """A fragment does not continue the message being reassembled."""


def split(data: bytes, message_id: int, max_fragment_bytes: int = MAX_FRAGMENT_BYTES) -> list[peer_pb2.Fragment]:
    """Cut `data` into fragments of at most `max_fragment_bytes`."""
    count = max(1, -(-len(data) // max_fragment_bytes))
    view = memoryview(data)
    return [
        peer_pb2.Fragment(
            message_id=message_id,
            index=index,
            count=count,
            chunk=bytes(view[index * max_fragment_bytes : (index + 1) * max_fragment_bytes]),
        )
        for index in range(count)
    ]


class Reassembler:
    """Puts the fragments arriving on one link back together."""

    def __init__(self, max_message_bytes: int = MAX_MESSAGE_BYTES, budget: ReassemblyBudget | None = None) -> None:
        self.max_message_bytes = max_message_bytes
        self.budget = budget if budget is not None else ReassemblyBudget()
        self._message_id: int | None = None
        self._chunks: list[bytes] = []
        self._size = 0

    def add(self, fragment: peer_pb2.Fragment) -> bytes | None:
        """Add the next fragment; returns the whole message once complete."""
        if fragment.count < 1 or fragment.index >= fragment.count:
            self._reset()
            raise FragmentError(f"fragment {fragment.index} of {fragment.count}")
        if fragment.index == 0:
            if self._message_id is not None:
                self._reset()
                raise FragmentError(f"message {fragment.message_id} started inside another")
            self._message_id = fragment.message_id
        elif fragment.message_id != self._message_id or fragment.index != len(self._chunks):
            self._reset()
            raise FragmentError(f"fragment {fragment.index} of message {fragment.message_id} out of order")
        if self._size + len(fragment.chunk) > self.max_message_bytes:
            self._reset()
            raise FragmentError(f"message larger than {self.max_message_bytes} bytes")
        if not self.budget.take(len(fragment.chunk)):
            self._reset()
            raise FragmentError(
                f"the node's links hold {self.budget.held_bytes} bytes of partial messages already "
                f"(the reassembly budget is {self.budget.limit_bytes})"
            )
        self._size += len(fragment.chunk)
        self._chunks.append(fragment.chunk)
        if fragment.index + 1 < fragment.count:
            return None
        data = b"".join(self._chunks)
        self._reset()
        return data

    def release(self) -> None:
        """Drop the partial message (its link ended), giving its bytes back to the budget."""
        self._reset()

    def _reset(self) -> None:
        self.budget.give_back(self._size)
        self._message_id = None
        self._chunks = []
        self._size = 0
