"""Fragmentation of large ring messages on a link.

Responsible for: cutting a serialized RingMessage larger than
`MAX_FRAGMENT_BYTES` into numbered fragments, and putting them back together.
Guarantees: the reassembled bytes equal the original; fragments of one message
travel consecutively on one link (FIFO), so a receiver holds at most one
partial message per link; malformed or oversized input is refused with
`FragmentError`, never half-delivered.
"""

from __future__ import annotations

from ringq.v1 import peer_pb2

MAX_FRAGMENT_BYTES = 64 * 1024
# A bound on one reassembled message, so a broken peer cannot exhaust memory.
MAX_MESSAGE_BYTES = 1024 * 1024 * 1024


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

    def __init__(self, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.max_message_bytes = max_message_bytes
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
        self._size += len(fragment.chunk)
        if self._size > self.max_message_bytes:
            self._reset()
            raise FragmentError(f"message larger than {self.max_message_bytes} bytes")
        self._chunks.append(fragment.chunk)
        if fragment.index + 1 < fragment.count:
            return None
        data = b"".join(self._chunks)
        self._reset()
        return data

    def _reset(self) -> None:
        self._message_id = None
        self._chunks = []
        self._size = 0
