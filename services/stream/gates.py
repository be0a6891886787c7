"""Which broker groups this node still lets take sends, for the consumers' drain check.

Responsible for: sealing a group's generation before consumers report it drained, and counting the
publish batches in flight into each group on this node. A group's publishes and its consumers are both
served where its master runs, so a consume session that seals generation g of a group and then sees no
batch of g in flight and nothing left in the group knows nothing more of g will arrive: a publish session
of g checks the seal before each batch (in the same event loop step as it hands the batch to the queue),
so a session that went on writing after the coordinator struck the group from the send list cannot put a
message behind a group the consume list has already left.

Pure bookkeeping, no I/O: the asyncio wait for in-flight batches is the caller's.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass
class _Gate:
    sealed_through: int = 0  # generations up to this one take no more sends here
    in_flight: dict[int, int] = field(default_factory=dict)  # generation -> batches not yet confirmed
    idle: asyncio.Event = field(default_factory=asyncio.Event)


class GroupGates:
    def __init__(self) -> None:
        self._gates: dict[tuple[str, str], _Gate] = {}

    def _gate(self, key: tuple[str, str]) -> _Gate:
        gate = self._gates.get(key)
        if gate is None:
            gate = self._gates[key] = _Gate()
            gate.idle.set()
        return gate

    def open_for(self, key: tuple[str, str], generation: int) -> bool:
        return generation > self._gate(key).sealed_through

    def batch_started(self, key: tuple[str, str], generation: int) -> None:
        gate = self._gate(key)
        gate.in_flight[generation] = gate.in_flight.get(generation, 0) + 1
        gate.idle.clear()

    def batch_ended(self, key: tuple[str, str], generation: int) -> None:
        gate = self._gate(key)
        left = gate.in_flight.get(generation, 0) - 1
        if left > 0:
            gate.in_flight[generation] = left
        else:
            gate.in_flight.pop(generation, None)
        if not any(g <= gate.sealed_through for g in gate.in_flight):
            gate.idle.set()

    async def seal(self, key: tuple[str, str], generation: int) -> None:
        """Seal `generation` (and older ones) and return once no batch of them is in flight here."""
        gate = self._gate(key)
        gate.sealed_through = max(gate.sealed_through, generation)
        while any(g <= gate.sealed_through for g in gate.in_flight):
            gate.idle.clear()
            await gate.idle.wait()
