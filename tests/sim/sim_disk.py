"""A node's disk in the queue simulation: one message log, with the faults real disks have.

Responsible for: keeping a replica's log as flush groups (what a completed flush made durable) plus
a buffer (appended, not flushed), and producing what `FileMessageLog` would recover after a restart.
Faults: a crash drops the buffer and any flush in progress (torn writes never count); `damage`
corrupts one durable operation in the middle (recovery salvages around it and claims only the
intact prefix, as message_log.py does with its COMMIT records); `cut_tail` loses the last durable
flush (a tail cut by a few bytes loses its COMMIT record, so the whole flush; the same as a disk
that lied about an fsync); `full` makes every flush fail until it is cleared. A failed log stays on the
disk once the disk writes again, as replica_log.py leaves its generation: appends are dropped until a
WriteLog replaces it, at that write's first flush, so a restart in between finds the old log.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.queue.durability import Claim, Position
from services.queue.ops import Message
from services.queue.replica_core import LogRecovery


@dataclass(frozen=True)
class Op:
    """One log operation: an enqueue, a removal or a mark."""

    enqueued: Message | None = None
    removed: tuple[int, ...] = ()
    mark: Position | None = None


@dataclass
class SimDisk:
    groups: list[list[Op]] = field(default_factory=list)  # durable, one list per completed flush
    buffer: list[Op] = field(default_factory=list)
    fresh: list[Op] | None = None  # a fresh log being written: replaces `groups` at its flush
    failed: bool = False  # a flush failed: the log refuses everything until a fresh one is opened
    full: bool = False
    damaged_at: tuple[int, int] | None = None  # (group, op) corrupted on the medium
    # Whether the disk holds its log: DiscardLog removes it (a mirror that starts over).
    exists: bool = False
    # Damaged or cut since its log was last written whole: the fault model never spoils every listed replica.
    spoiled: bool = False
    # The disk writes again after a failure: the failed log is kept, written to only by a fresh WriteLog.
    replaced_next: bool = False

    # ---------------------------------------------------------------- writing

    def append(self, ops: list[Op]) -> None:
        if not self.failed and self.exists and not self.replaced_next:
            self.buffer.extend(ops)

    def write_exactly(self, messages: tuple[Message, ...], position: Position, fresh: bool) -> None:
        """WriteLog: hold exactly `messages`, by a delta when it can be appended in id order."""
        if self.failed:
            return
        if self.replaced_next:
            fresh, self.replaced_next = True, False
        live = self._replay(self._all_ops())[0] if self.exists and not fresh else None
        wanted = {m.id: m for m in messages}
        if live is not None and self.damaged_at is None:
            adds = [m for i, m in sorted(wanted.items()) if i not in live]
            last = max(self._enqueued_ids(), default=0)
            if not adds or adds[0].id > last:
                removed = tuple(i for i in live if i not in wanted)
                self.buffer += [Op(removed=removed), *(Op(enqueued=m) for m in adds), Op(mark=position)]
                return
        self.exists = True
        self.fresh = [*(Op(enqueued=m) for _, m in sorted(wanted.items())), Op(mark=position)]
        self.buffer = []

    def flush(self) -> bool:
        """Complete a flush; False if the disk failed it."""
        if self.failed or self.full:
            self.failed = True
            self.buffer = []
            self.fresh = None
            return False
        if self.fresh is not None:
            self.groups = [self.fresh + self.buffer]
            self.fresh = None
            self.damaged_at = None
            self.spoiled = False
        elif self.buffer:
            self.groups.append(self.buffer)
        self.buffer = []
        return True

    def discard(self) -> None:
        self.groups, self.buffer, self.fresh = [], [], None
        self.damaged_at = None
        self.exists = False
        self.spoiled = False
        self.replaced_next = False

    def reopen_fresh(self) -> bool:
        """WatchDisk's retry: if the disk writes again, the failed log is closed (it stays, as written) and
        the next WriteLog writes a fresh one."""
        if self.full:
            return False
        self.buffer, self.fresh = [], None
        self.failed = False
        self.replaced_next = True
        return True

    def close(self) -> None:
        """Its replica stopped, the node lives on: the log is closed without a flush (replica_log.py), so
        what was appended since the last flush is dropped, as in a crash; a replica recreated on the node
        finds only what was flushed, and its own flushes must not carry its predecessor's appends."""
        self.crash()

    def crash(self) -> None:
        self.buffer = []
        self.fresh = None
        self.failed = False
        self.replaced_next = False

    # ---------------------------------------------------------------- faults

    def damage(self, group: int, op: int) -> None:
        self.damaged_at = (group, op)
        self.spoiled = True

    def cut_tail(self) -> None:
        if self.groups:
            self.groups.pop()
            self.spoiled = True

    # ---------------------------------------------------------------- reading

    def durable_ids(self) -> set[int]:
        """The messages the durable part of the log holds (what a restart would recover)."""
        if not self.exists:
            return set()
        return set(self._replay(self._durable_ops())[0])

    def recover(self) -> LogRecovery | None:
        """What a restarted replica finds: None if there is no log."""
        if not self.exists:
            return None
        ops = self._durable_ops()
        messages, position = self._replay(ops)
        damage: tuple[str, ...] = ()
        claim = Claim(position)
        if self.damaged_at is not None:
            before = self._flat_index(self.damaged_at)
            _, intact = self._replay(ops[:before])
            claim = Claim(intact, damaged=True)
            damage = (f"operation {before} of the log is corrupt",)
        restored = tuple(sorted(messages.values(), key=lambda m: m.id))
        return LogRecovery(tuple(_copy(m) for m in restored), claim, damage)

    def _durable_ops(self) -> list[Op]:
        ops = [op for group in self.groups for op in group]
        if self.damaged_at is not None:
            index = self._flat_index(self.damaged_at)
            ops = ops[:index] + ops[index + 1 :]
        return ops

    def _all_ops(self) -> list[Op]:
        return self._durable_ops() + self.buffer

    def _flat_index(self, where: tuple[int, int]) -> int:
        group, op = where
        return sum(len(g) for g in self.groups[:group]) + op

    def _enqueued_ids(self) -> list[int]:
        return [op.enqueued.id for op in self._all_ops() if op.enqueued is not None]

    @staticmethod
    def _replay(ops: list[Op]) -> tuple[dict[int, Message], Position]:
        live: dict[int, Message] = {}
        position = Position()
        for op in ops:
            if op.enqueued is not None:
                live[op.enqueued.id] = op.enqueued
            elif op.mark is not None:
                position = op.mark
            else:
                for message_id in op.removed:
                    live.pop(message_id, None)
        return live, position


def _copy(message: Message) -> Message:
    """As written to or read from disk: a new object (the replica's own may change afterwards)."""
    return Message(
        message.id,
        message.body,
        message.publisher,
        message.publisher_seq,
        message.persistent,
        dict(message.headers),
        message.priority,
        message.enqueued_at_ms,
        message.expires_at_ms,
        message.delivery_count,
    )
