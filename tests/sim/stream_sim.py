"""Deterministic simulation of an ordered stream's lists (services/coordinator/stream_lists.py) under
seeded random schedules: groups losing and regaining replicas (the coordinator learning of it at once
or late), sends whose confirm is lost with a failing group, producer failovers (a standby takes the
lease with a higher fencing token; the old producer's late write is fenced off), consumer failovers
(what the old consumer had not acknowledged comes again, flagged redelivered), slow consumers and late
drained reports.

The world: each broker group holds the stream_seqs it stored, in order. A producer numbers its messages
(token << 32) | 1, 2, ... and sends each until a group confirms it; a send to a group that fails may
store the message and still fail, so it may be stored twice. A consumer reads the consume list's head
only. The broker drops a message at or below the lists' consumed_through (rule 5: a copy of one
consumed in an earlier group); the consumer's SDK drops a message at or below the last it delivered
unless the application holds it unacknowledged (then it comes again, flagged); the application
acknowledges later, in order. A consumer that finds its head read and acknowledged to the end reports
it drained with the highest stream_seq the group took, the report reaching the coordinator late.

Checked after every step: the lists' own invariants; every group holding unacknowledged messages is in
the consume list, and reading along it gives increasing stream_seqs apart from copies; the application
never saw a stream_seq at or below one it saw before unless it came flagged redelivered and had been
delivered before; nothing confirmed was skipped (every confirmed stream_seq below the highest delivered
was delivered). At the end, with every group healed: everything confirmed was delivered.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from services.coordinator.stream_lists import StreamLists, invariant_problems

TOKEN_SHIFT = 32


@dataclass
class Group:
    name: str
    live: int = 2  # replicas live (0, 1 or 2)
    stored: list[int] = field(default_factory=list)  # stream_seqs, in the order stored
    acked: set[int] = field(default_factory=set)  # indexes of `stored` acknowledged
    read: int = 0  # the next index to hand the current consumer instance
    delivered_before: set[int] = field(default_factory=set)  # indexes handed to some consumer instance
    highest: int = 0  # the highest stream_seq it ever took (its publisher seqs outlive its messages)

    def unacked(self) -> list[int]:
        return [seq for index, seq in enumerate(self.stored) if index not in self.acked]


@dataclass
class StreamSim:
    seed: int
    steps: int = 400
    rng: random.Random = field(init=False)
    groups: dict[str, Group] = field(init=False)
    lists: StreamLists = field(init=False)
    token: int = 1  # the producer lease's fencing token
    counter: int = 0  # the active producer's messages so far
    sending: int | None = None  # a stream_seq sent and not confirmed yet
    confirmed: set[int] = field(default_factory=set)
    app: list[tuple[int, bool]] = field(default_factory=list)  # (stream_seq, redelivered) as the app saw them
    app_seen: set[int] = field(default_factory=set)
    app_checked: int = 0
    app_highest: int = 0
    in_hand: list[tuple[str, int, int]] = field(default_factory=list)  # (group, index, seq) not acked yet
    instance_last: int = 0  # the consumer SDK's last delivered stream_seq (reset by a failover)
    duplicates: int = 0  # copies the consumer SDK dropped
    broker_dropped: int = 0  # copies the broker dropped (rule 5)
    producer_failovers: int = 0
    consumer_failovers: int = 0
    fenced: int = 0  # late writes of a replaced producer, refused
    reports: list[tuple[int, str, int, int]] = field(default_factory=list)  # (due, group, generation, through)
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
        if roll < 0.34:
            self._send()
        elif roll < 0.56:
            self._consume()
        elif roll < 0.66:
            self._ack()
        elif roll < 0.72:
            self._fail_a_group()
        elif roll < 0.80:
            self._heal_a_group()
        elif roll < 0.87:
            self._deliver_reports()
        elif roll < 0.91:
            self._observe()
        elif roll < 0.955:
            self._producer_failover()
        else:
            self._consumer_failover()

    def _send(self) -> None:
        self.lists, group_name = self.lists.pick()
        if group_name is None:
            return  # every group is down or has backlog: the producer waits
        group = self.groups[group_name]
        if self.sending is None:
            self.counter += 1
            self.sending = (self.token << TOKEN_SHIFT) | self.counter
        seq = self.sending
        if group.live < 2:
            return  # the group refuses: a replica is missing (the coordinator learns of it later)
        if seq not in group.stored:  # the queue drops a resend of the same publisher seq
            group.stored.append(seq)
            group.highest = max(group.highest, seq)
        if self.rng.random() < 0.1:  # the group fails while confirming: stored, but unconfirmed
            group.live = 1
            return
        self.confirmed.add(seq)
        self.sending = None

    def _producer_failover(self) -> None:
        """The active producer stops (its unconfirmed message abandoned, perhaps stored); a standby takes
        the lease with the next token; the old one's late write carries the old token and is refused."""
        old_token, late = self.token, self.sending
        self.token += 1
        self.counter = 0
        self.sending = None
        self.producer_failovers += 1
        if late is not None:
            assert late >> TOKEN_SHIFT == old_token < self.token  # the broker's fencing check refuses it
            self.fenced += 1

    def _consume(self) -> None:
        head = self.lists.consume_head
        if head is None:
            return
        generation = self.lists.generation(head)
        group = self.groups[head]
        if group.live == 0:
            return  # both replicas lost: consumption stalls, never skips ahead
        while group.read < len(group.stored) and group.read in group.acked:
            group.read += 1
        if group.read < len(group.stored):
            index = group.read
            group.read += 1
            seq = group.stored[index]
            redelivered = index in group.delivered_before
            group.delivered_before.add(index)
            if seq <= self.lists.consumed_through:  # a copy of one consumed in an earlier group (rule 5)
                group.acked.add(index)
                self.broker_dropped += 1
            elif seq <= self.instance_last:
                if any(held == seq for _, _, held in self.in_hand):  # the application holds it: again
                    self._hand(head, index, seq, True)
                else:
                    group.acked.add(index)  # a copy: the SDK acknowledges and drops it
                    self.duplicates += 1
            else:
                self.instance_last = seq
                self._hand(head, index, seq, redelivered)
        elif len(group.acked) == len(group.stored) and self.lists.send_group != head:
            delay = self.rng.choice((0, 0, 1, 5, 30))
            self.reports.append((self.step + delay, head, generation, group.highest))

    def _hand(self, group: str, index: int, seq: int, redelivered: bool) -> None:
        self.app.append((seq, redelivered))
        self.in_hand.append((group, index, seq))

    def _ack(self) -> None:
        """The application acknowledges what it holds, oldest first (some of it)."""
        for _ in range(self.rng.randint(1, 3)):
            if not self.in_hand:
                return
            group, index, _ = self.in_hand.pop(0)
            self.groups[group].acked.add(index)

    def _consumer_failover(self) -> None:
        """The active consumer dies: what it held unacknowledged goes back to its group; a standby starts
        with no memory of what was delivered."""
        self.in_hand.clear()
        self.instance_last = 0
        self.consumer_failovers += 1
        for group in self.groups.values():
            group.read = next((i for i in range(len(group.stored)) if i not in group.acked), len(group.stored))

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
        for _, group, generation, through in due:
            before = self.lists
            self.lists = self.lists.drained(group, generation, through)
            if self.lists is not before:
                emptied = self.groups[group]
                assert len(emptied.acked) == len(emptied.stored), (
                    f"seed {self.seed}: {group} removed with unacknowledged messages"
                )
                emptied.stored, emptied.acked, emptied.read, emptied.delivered_before = [], set(), 0, set()

    # ------------------------------------------------------------------ checks

    def _check(self) -> None:
        where = f"seed {self.seed} step {self.step}"
        problems = invariant_problems(self.lists)
        assert not problems, f"{where}: {problems} in {self.lists}"
        unread = {name: g.unacked() for name, g in self.groups.items() if g.unacked()}
        missing = set(unread) - set(self.lists.consume)
        assert not missing, f"{where}: {missing} hold unacknowledged messages outside the consume list {self.lists}"
        along = [seq for name in self.lists.consume for seq in unread.get(name, [])]
        self._check_application(where)
        # What is still to be delivered for the first time, read along the consume list: increasing.
        firsts: list[int] = []
        for seq in along:
            if seq not in self.app_seen and seq > self.lists.consumed_through and seq not in firsts:
                firsts.append(seq)
        assert firsts == sorted(firsts), f"{where}: reading along the consume list gives {along}"

    def _check_application(self, where: str) -> None:
        """The deliveries since the last check (incrementally: `app_checked`, `app_highest`)."""
        for seq, redelivered in self.app[self.app_checked :]:
            if seq <= self.app_highest:
                assert redelivered and seq in self.app_seen, (
                    f"{where}: the application saw {seq} after {self.app_highest} unflagged"
                )
            self.app_seen.add(seq)
            self.app_highest = max(self.app_highest, seq)
        self.app_checked = len(self.app)
        skipped = {seq for seq in self.confirmed if seq < self.app_highest} - self.app_seen
        assert not skipped, (
            f"{where}: confirmed {sorted(skipped)[:5]} skipped (the application is at {self.app_highest})"
        )

    def _heal_and_drain(self) -> None:
        """Heal everything, finish sending, read and acknowledge everything: whatever was confirmed reaches
        the application."""
        for group in self.groups.values():
            group.live = 2
            self.lists = self.lists.replicas_back(group.name)
        for _ in range(20_000):
            if self.sending is not None:
                self._send()
            self._consume()
            self._ack()
            self.step += 1
            self._deliver_reports()
            self._check()
            if self.sending is None and not self.in_hand and all(not g.unacked() for g in self.groups.values()):
                break
        assert self.confirmed <= self.app_seen, (
            f"seed {self.seed}: confirmed but never delivered: {sorted(self.confirmed - self.app_seen)[:10]}"
        )


def stream_counts(seed: int) -> dict[str, int]:
    """Run one seed (a failure raises); what its schedule did (for tests/sim/parallel.py's workers)."""
    sim = StreamSim(seed).run()
    return {
        "duplicates": sim.duplicates,
        "broker_dropped": sim.broker_dropped,
        "producer_failovers": sim.producer_failovers,
        "consumer_failovers": sim.consumer_failovers,
        "fenced": sim.fenced,
        "redelivered": sum(flag for _, flag in sim.app),
    }
