"""The messages a queue holds, by id: a read-only mapping that costs about 10 bytes a message where a
dict costs 42 to 52 (issue 13: memory per queued message).

Responsible for: finding a message by id, adding and removing one, and walking them in id order.

How: ids grow with arrival, so a queue's ids come in long runs. The table cuts the id space into
chunks of CHUNK ids and keeps a list for each chunk that holds at least one message (the chunk's
count, then one slot per id, None where there is no message), in a dict by chunk number. A dense run
costs one pointer a message plus a chunk's overhead shared by CHUNK messages; a chunk is freed as
soon as its last message leaves.

Guarantees:
- Iteration is in ascending id order (a dict's is insertion order, which a sync batch breaks).
- Memory is bounded by the messages held, whatever their ids: at worst (one message in a chunk) a
  message costs a chunk, about 640 bytes; ids far apart (a new master's epoch) cost nothing between.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from services.queue.ops import Message

CHUNK_BITS = 6
CHUNK = 1 << CHUNK_BITS
_SLOT_MASK = CHUNK - 1
_EMPTY_CHUNK: tuple[Any, ...] = (0,) + (None,) * CHUNK  # a chunk's list is made from this


class MessageTable(Mapping[int, Message]):
    """Messages by id, in chunks (see the module docstring). Changed only through `add` and `pop_many`."""

    __slots__ = ("_chunks", "_count")

    def __init__(self) -> None:
        # chunk number -> [count, message or None for each of the chunk's CHUNK ids]
        self._chunks: dict[int, list[Any]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def get(self, message_id: int, default: Any = None) -> Any:
        chunk = self._chunks.get(message_id >> CHUNK_BITS)
        if chunk is None:
            return default
        message = chunk[(message_id & _SLOT_MASK) + 1]
        return default if message is None else message

    def __getitem__(self, message_id: int) -> Message:
        chunk = self._chunks.get(message_id >> CHUNK_BITS)
        message: Message | None = None if chunk is None else chunk[(message_id & _SLOT_MASK) + 1]
        if message is None:
            raise KeyError(message_id)
        return message

    def __contains__(self, message_id: object) -> bool:
        if not isinstance(message_id, int):
            return False
        chunk = self._chunks.get(message_id >> CHUNK_BITS)
        return chunk is not None and chunk[(message_id & _SLOT_MASK) + 1] is not None

    def __iter__(self) -> Iterator[int]:
        """Ids, ascending (each the message's own int object: nothing is allocated per id)."""
        for message in self.values():
            yield message.id

    def values(self) -> Iterator[Message]:  # type: ignore[override]
        """Messages, in ascending id order."""
        chunks = self._chunks
        for number in sorted(chunks):
            chunk = chunks.get(number)
            if chunk is None:  # freed while the caller walked
                continue
            for message in chunk[1:]:
                if message is not None:
                    yield message

    def add(self, message: Message) -> bool:
        """Hold `message`; False (and nothing changed) if its id is held already."""
        message_id = message.id
        number = message_id >> CHUNK_BITS
        chunk = self._chunks.get(number)
        if chunk is None:
            chunk = self._chunks[number] = list(_EMPTY_CHUNK)
        slot = (message_id & _SLOT_MASK) + 1
        if chunk[slot] is not None:
            return False
        chunk[slot] = message
        chunk[0] += 1
        self._count += 1
        return True

    def pop_many(self, message_ids: Iterable[int]) -> list[Message]:
        """Remove the messages `message_ids` held here and return them (`pop` for each, in one call)."""
        chunks = self._chunks
        removed: list[Message] = []
        for message_id in message_ids:
            number = message_id >> CHUNK_BITS
            chunk = chunks.get(number)
            if chunk is None:
                continue
            slot = (message_id & _SLOT_MASK) + 1
            message = chunk[slot]
            if message is None:
                continue
            chunk[slot] = None
            removed.append(message)
            if chunk[0] == 1:
                del chunks[number]
            else:
                chunk[0] -= 1
        self._count -= len(removed)
        return removed

    def release(self, chunks: int) -> bool:
        """Let go of up to `chunks` chunks, and the messages only they held (a table freed a slice at a
        time once its queue stopped, so that no one step frees a deep queue); True once it is empty."""
        table = self._chunks
        for _ in range(min(chunks, len(table))):
            _, chunk = table.popitem()
            self._count -= chunk[0]
        return not table

    def compact(self) -> None:
        """Rebuild the chunk dict at its present size: a dict never shrinks as items leave."""
        self._chunks = dict(self._chunks)

    def __sizeof__(self) -> int:
        chunks = self._chunks
        return object.__sizeof__(self) + sys.getsizeof(chunks) + sum(sys.getsizeof(c) for c in chunks.values())

    def __repr__(self) -> str:
        return f"MessageTable({self._count} messages in {len(self._chunks)} chunks)"
