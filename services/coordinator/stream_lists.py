"""An ordered stream's send list and consume list: which broker group takes sends, which one consumers
read, as a pure state machine (seed 001, ARCHITECTURE.md section 4).

The model
---------
A stream owns two or more *broker groups*; each is a queue with exactly two replicas on two nodes,
which confirms a message only once both hold it. The coordinator keeps two lists per stream, durably
(each change one compare-and-set of the stream's record):

    send list     groups that may take sends, in the order they will; only its head takes them
    consume list  groups that hold (or may hold) messages, in the order they took them; consumers
                  read only its head

and, per group, its *generation*: how many times it was picked to take sends. A group in the consume
list is one that may hold messages not consumed yet (the seed's "backlog" mark). The rules:

1. Picking: a producer asks where to send. The head of the send list is the answer, but first it is
   appended to the consume list (if it is not already its tail) and its generation raised, and that
   change is stored, *before* the producer hears of the group. So no group
   ever holds a message that the consume list does not name, in the order the groups took them.
2. A group that lost a replica is struck from the send list at once (its surviving replica refuses
   sends, so the stream never holds a message in one copy only); it stays in the consume list and its
   survivor still serves consumers.
3. Consumers read the head of the consume list only. When they have consumed and acknowledged all of
   it and it is not the send list's head (nothing can be added to it any more), they report it
   drained, naming the generation they read; the coordinator then removes it from the consume list.
   A report of an older generation is ignored.
4. A group joins the tail of the send list only when both its replicas are live and it is not in the
   consume list: it has no backlog. (A group still in the consume list, even empty, would put the
   messages it took now behind messages of later groups that consumers have not read yet.)
5. A drained report also names the highest stream_seq consumers acknowledged in the group; the lists
   keep the highest (`consumed_through`), and consumers drop any message at or below it: a copy a
   producer's failover stored in a later group is never delivered again, not even to a consumer
   instance that took over and so cannot know what its predecessor saw.

What it guarantees
------------------
- Total order: the messages the stream accepted, read group by group along the consume list, come in
  the order they were accepted; consumers never skip ahead (a head that cannot be read, both its
  replicas lost, stalls consumption until one comes back with its log).
- Two copies: sends go only to a group with both replicas live (the broker group refuses otherwise).
- At most one group takes sends: the send list's head.

The hard cases
--------------
- The coordinator answers a pick, then crashes: the pick was stored before the answer, so the group is
  in the consume list whatever happens next.
- A drained report arrives late, after its group took sends again: it names an older generation and
  is ignored, so a group is never removed while it holds unread messages.
- The head of the consume list drains while it is also the send group: it stays (sends may come);
  it leaves once another group took over sends and consumers finished it.
- A group that took no message before the producer moved on (it failed at once) sits in the consume
  list empty; consumers find it empty at the head, report it, and it goes.
- Every group is down or in the consume list: the send list is empty and producers wait (`pick`
  answers None).

Pure: no I/O, no clock; each operation returns a new StreamLists (or the same one if nothing changes).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class StreamLists:
    """One stream's lists and group marks (what the coordinator stores for it)."""

    groups: tuple[str, ...]
    send: tuple[str, ...]
    consume: tuple[str, ...] = ()
    down: frozenset[str] = frozenset()  # groups with a replica missing
    generations: Mapping[str, int] = field(default_factory=dict)
    # The highest stream_seq consumers acknowledged in groups already drained: a copy at or below it in a
    # later group (stored twice by a producer's failover) is dropped by the broker, whichever consumer
    # instance reads it (rule 5).
    consumed_through: int = 0

    @classmethod
    def new(cls, groups: Iterable[str]) -> StreamLists:
        """A new stream: every group may take sends, in the order given; nothing to consume."""
        names = tuple(groups)
        if len(names) < 2 or len(set(names)) != len(names):
            raise ValueError(f"a stream needs two or more distinct groups, got {list(names)}")
        return cls(names, names, generations={name: 0 for name in names})

    # ------------------------------------------------------------------ questions

    @property
    def send_group(self) -> str | None:
        """The group that takes sends now (once picked), or None: producers wait."""
        return self.send[0] if self.send else None

    @property
    def consume_head(self) -> str | None:
        """The only group consumers may read, or None: nothing to consume."""
        return self.consume[0] if self.consume else None

    def generation(self, group: str) -> int:
        return self.generations.get(group, 0)

    def eligible(self, group: str) -> bool:
        """May `group` join the send list now (rule 4)?"""
        return group not in self.down and group not in self.consume

    def why_not_eligible(self, group: str) -> str:
        if group in self.down:
            return f"group {group!r} has a replica missing"
        if group in self.consume:
            return f"group {group!r} may still hold messages consumers have not read (it is in the consume list)"
        return ""

    # ------------------------------------------------------------------ changes

    def pick(self) -> tuple[StreamLists, str | None]:
        """Where a producer sends (rule 1): the send list's head, once it is the consume list's tail."""
        group = self.send_group
        if group is None:
            return self, None
        if self.consume and self.consume[-1] == group:
            return self, group  # picked already: it is taking sends
        assert group not in self.consume, "a group in the consume list never joins the send list (rule 4)"
        picked = replace(
            self,
            consume=(*self.consume, group),
            generations={**self.generations, group: self.generation(group) + 1},
        )
        return picked, group

    def replica_lost(self, group: str) -> StreamLists:
        """`group` has a replica missing (rule 2): it takes no more sends."""
        self._known(group)
        if group in self.down:
            return self
        return replace(self, send=tuple(g for g in self.send if g != group), down=self.down | {group})

    def replicas_back(self, group: str) -> StreamLists:
        """Both replicas of `group` are live again: it rejoins the send list if it may (rule 4)."""
        self._known(group)
        if group not in self.down:
            return self
        return replace(self, down=self.down - {group})._readmit([group])

    def drained(self, group: str, generation: int, through: int = 0) -> StreamLists:
        """Consumers read and acknowledged all of `group` of `generation` (rule 3), up to stream_seq
        `through` (rule 5)."""
        self._known(group)
        if generation != self.generation(group) or self.consume_head != group or self.send_group == group:
            return self  # stale, not the head, or still taking sends: nothing to do
        consumed = max(self.consumed_through, through)
        return replace(self, consume=self.consume[1:], consumed_through=consumed)._readmit([group])

    def observe(self, whole: Mapping[str, bool]) -> StreamLists:
        """Apply what the coordinator sees of each group (True: both replicas live and in step)."""
        lists = self
        for group, is_whole in whole.items():
            lists = lists.replicas_back(group) if is_whole else lists.replica_lost(group)
        return lists

    def _readmit(self, groups: Iterable[str]) -> StreamLists:
        joining = tuple(g for g in groups if g not in self.send and self.eligible(g))
        return replace(self, send=(*self.send, *joining)) if joining else self

    def _known(self, group: str) -> None:
        if group not in self.groups:
            raise KeyError(f"no group {group!r} in this stream ({', '.join(self.groups)})")


def invariant_problems(lists: StreamLists) -> list[str]:
    """What is wrong with `lists` by the rules above (empty if nothing): for tests and the simulator."""
    problems = []
    for group in lists.send[1:]:
        if group in lists.consume:
            problems.append(f"{group} waits in the send list while in the consume list (with backlog)")
    for group in lists.send:
        if group in lists.down:
            problems.append(f"{group} is in the send list with a replica missing")
    if len(set(lists.consume)) != len(lists.consume):
        problems.append(f"the consume list names a group twice: {lists.consume}")
    if lists.send and lists.send[0] in lists.consume and lists.consume[-1] != lists.send[0]:
        problems.append(f"the send group {lists.send[0]} is in the consume list but not its tail")
    return problems
