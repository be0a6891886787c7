"""Pending publications of one publisher, as one run of consecutive sequence numbers.

Responsible for: holding the bodies a member keeps until it learns they are
acknowledged everywhere (or, at their owner, until they come back round the
ring). Publications of one publisher are consecutive, so the run is stored as
chunks (the batches they arrived in) and trimmed by sequence number: the cost
of a batch is per chunk, not per message. Guarantees: `first_seq .. end_seq-1`
are exactly the sequence numbers held, in order, with no gap.
"""

from __future__ import annotations

from collections import deque


class PendingRun:
    """Consecutive publications `first_seq .. end_seq - 1` of one publisher."""

    __slots__ = ("_chunks", "_count", "first_seq")

    def __init__(self, first_seq: int = 1) -> None:
        # Each chunk is (sequence number of its first body, bodies).
        self._chunks: deque[tuple[int, list[bytes]]] = deque()
        self._count = 0
        self.first_seq = first_seq

    def __len__(self) -> int:
        return self._count

    @property
    def end_seq(self) -> int:
        """One past the last held sequence number."""
        return self.first_seq + self._count

    def append(self, first_seq: int, bodies: list[bytes]) -> None:
        """Add bodies numbered from `first_seq`, which must follow the run."""
        if not bodies:
            return
        if self._count == 0:
            self.first_seq = first_seq
        elif first_seq != self.end_seq:
            raise ValueError(f"pending run ends at {self.end_seq - 1}, cannot append {first_seq}")
        self._chunks.append((first_seq, bodies))
        self._count += len(bodies)

    def drop_through(self, seq: int) -> int:
        """Forget every body numbered up to and including `seq`; returns how many."""
        if self._count == 0 or seq < self.first_seq:
            return 0
        dropped = 0
        chunks = self._chunks
        while chunks:
            chunk_first, bodies = chunks[0]
            chunk_last = chunk_first + len(bodies) - 1
            if chunk_last <= seq:
                chunks.popleft()
                dropped += len(bodies)
                continue
            if chunk_first <= seq:
                keep = bodies[seq - chunk_first + 1 :]
                chunks[0] = (seq + 1, keep)
                dropped += len(bodies) - len(keep)
            break
        self._count -= dropped
        self.first_seq = seq + 1 if self._count == 0 else chunks[0][0]
        return dropped

    def clear_through_end(self) -> None:
        """Forget everything; the run continues after its current end."""
        self.first_seq = self.end_seq
        self._chunks.clear()
        self._count = 0

    def bodies(self) -> list[bytes]:
        """Every held body, in order (a copy)."""
        out: list[bytes] = []
        for _, bodies in self._chunks:
            out.extend(bodies)
        return out

    def body(self, seq: int) -> bytes:
        """The body numbered `seq` (for checkers; linear in the chunk count)."""
        for chunk_first, bodies in self._chunks:
            if chunk_first <= seq < chunk_first + len(bodies):
                return bodies[seq - chunk_first]
        raise KeyError(seq)
