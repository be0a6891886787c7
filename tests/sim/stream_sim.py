"""Deterministic simulation of an ordered stream's lists (services/coordinator/stream_lists.py) under
seeded random schedules: groups losing and regaining replicas (the coordinator learning of it at once
or late), sends whose confirm is lost with a failing group, slow consumers and late drained reports.
(Producers and consumers keep no state the lists depend on: a restarted one asks the lists again.)

The world: each broker group holds the stream sequence numbers it stored, in order; a producer numbers
messages 1, 2, ... and sends each until one group confirms it (a send to a group that fails may store
the message and still fail, so it may be stored twice); a consumer reads the consume list's head only,
hands the application each sequence number above the last it handed (dropping duplicates, as the SDK
does) and reports a finished group drained, the report reaching the coordinator after a random delay.

Checked after every step: the lists' own invariants; every group holding unread messages is in the
consume list, and reading along it gives non-decreasing sequence numbers; the application saw
1, 2, 3, ... with nothing skipped. At the end, with every group healed: everything confirmed was read.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from services.coordinator.stream_lists import StreamLists, invariant_problems


@dataclass
class Group:
    name: str
    live: int = 2  # replicas live (0, 1 or 2)
    stored: list[int] = field(default_factory=list)  # stream seqs, in the order stored
    read: int = 0  # how many of `stored` the consumer acknowledged


@dataclass
class StreamSim:
    seed: int
    steps: int = 400
    rng: random.Random = field(init=False)
    groups: dict[str, Group] = field(init=False)
    lists: StreamLists = field(init=False)
    next_seq: int = 1
    sending: int | None = None  # a seq sent and not confirmed yet
    confirmed: set[int] = field(default_factory=set)
    delivered: list[int] = field(default_factory=list)
    duplicates: int = 0
    reports: list[tuple[int, str, int]] = field(default_factory=list)  # (due step, group, generation)
    step: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        names = [f"g{i}" for i in range(self.rng.randint(2, 4))]
        self.groups = {name: Group(name) for name in names}
        self.lists = StreamLists.new(names)

    def run(self) -> StreamSim:
        for step in range(self.steps):
            self.step = step
            self._act(self.rng.random())
            self._check()
        self._heal_and_drain()
        return self

    # ------------------------------------------------------------------ actions

    def _act(self, roll: float) -> None:
        if roll < 0.40:
            self._send()
        elif roll < 0.70:
            self._consume()
        elif roll < 0.78:
            self._fail_a_group()
        elif roll < 0.88:
            self._heal_a_group()
        elif roll < 0.95:
            self._deliver_reports()
        else:
            self._observe()

    def _send(self) -> None:
        self.lists, group_name = self.lists.pick()
        if group_name is None:
            return  # every group is down or has backlog: the producer waits
        group = self.groups[group_name]
        seq = self.sending if self.sending is not None else self.next_seq
        self.sending = seq
        if self.next_seq == seq:
            self.next_seq += 1
        if group.live < 2:
            return  # the group refuses: a replica is missing (the coordinator learns of it later)
        group.stored.append(seq)
        if self.rng.random() < 0.1:  # the group fails while confirming: stored, but unconfirmed
            group.live = 1
            return
        self.confirmed.add(seq)
        self.sending = None

    def _consume(self) -> None:
        head = self.lists.consume_head
        if head is None:
            return
        generation = self.lists.generation(head)
        group = self.groups[head]
        if group.live == 0:
            return  # both replicas lost: consumption stalls, never skips ahead
        if group.read < len(group.stored):
            seq = group.stored[group.read]
            group.read += 1
            if self.delivered and seq <= self.delivered[-1]:
                self.duplicates += 1  # stored twice by a failover: the SDK drops it
            else:
                self.delivered.append(seq)
        elif self.lists.send_group != head:
            delay = self.rng.choice((0, 0, 1, 5, 30))
            self.reports.append((self.step + delay, head, generation))

    def _fail_a_group(self) -> None:
        group = self.groups[self.rng.choice(list(self.groups))]
        if group.live == 0:
            return
        group.live -= self.rng.choice((1, 1, 2)) if group.live == 2 else 1
        self.lists = self.lists.replica_lost(group.name)

    def _observe(self) -> None:
        """The coordinator learns of replicas lost while a send was confirming (it learns late)."""
        for group in self.groups.values():
            if group.live < 2:
                self.lists = self.lists.replica_lost(group.name)

    def _heal_a_group(self) -> None:
        down = [g for g in self.groups.values() if g.live < 2]
        if not down:
            return
        group = self.rng.choice(down)
        group.live = 2  # back with its logs
        self.lists = self.lists.replicas_back(group.name)

    def _deliver_reports(self) -> None:
        due = [r for r in self.reports if r[0] <= self.step]
        self.reports = [r for r in self.reports if r[0] > self.step]
        for _, group, generation in due:
            before = self.lists
            self.lists = self.lists.drained(group, generation)
            if self.lists is not before:
                emptied = self.groups[group]
                assert emptied.read == len(emptied.stored), f"seed {self.seed}: {group} removed with unread messages"
                emptied.stored, emptied.read = [], 0

    # ------------------------------------------------------------------ checks

    def _check(self) -> None:
        where = f"seed {self.seed} step {self.step}"
        problems = invariant_problems(self.lists)
        assert not problems, f"{where}: {problems} in {self.lists}"
        unread = {name: g.stored[g.read :] for name, g in self.groups.items() if g.read < len(g.stored)}
        missing = set(unread) - set(self.lists.consume)
        assert not missing, f"{where}: {missing} hold unread messages outside the consume list {self.lists}"
        along = [seq for name in self.lists.consume for seq in unread.get(name, [])]
        assert along == sorted(along), f"{where}: reading along the consume list gives {along}"
        assert self.delivered == list(range(1, len(self.delivered) + 1)), (
            f"{where}: the application saw {self.delivered}"
        )
        if self.delivered:
            assert along == [] or along[0] >= self.delivered[-1], f"{where}: {along} behind {self.delivered[-1]}"

    def _heal_and_drain(self) -> None:
        """Heal everything, finish sending, read everything: whatever was confirmed reaches the application."""
        for group in self.groups.values():
            group.live = 2
            self.lists = self.lists.replicas_back(group.name)
        for _ in range(10_000):
            if self.sending is None and not self.lists.consume:
                break
            if self.sending is not None:
                self._send()
            self._consume()
            self.step += 1
            self._deliver_reports()
            self._check()
            if self.sending is None and all(g.read == len(g.stored) for g in self.groups.values()):
                break
        assert self.confirmed <= set(self.delivered), (
            f"seed {self.seed}: confirmed but never read: {sorted(self.confirmed - set(self.delivered))[:10]}"
        )
