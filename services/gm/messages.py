"""Inputs and outputs of the ring state machine (services/gm/ring.py).

Responsible for: the plain values the pure ring exchanges with its shell:
ring messages (what travels between neighbours) and actions (work the ring
asks its shell to do). The gRPC transport converts ring messages to and from
`ringq.v1.RingMessage`; the simulator passes them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.coordinator.group_table import Group, GroupChange

# ---------------------------------------------------------------------------
# Ring messages: sent by a member to its right neighbour only.
# ---------------------------------------------------------------------------


@dataclass(slots=True)
class PublisherActivity:
    """One publisher's publications and acknowledgement in an Activity.

    `pubs` are consecutive, numbered from `first_seq`; `acked_through`
    acknowledges every publication up to and including it (0: none).
    """

    publisher: str
    first_seq: int
    pubs: list[bytes]
    acked_through: int = 0


@dataclass(slots=True)
class Activity:
    """Publications and acknowledgements travelling round the ring.

    An Activity with no entries is a view notice: it only carries the
    sender's view version to the right, so the ring learns of changes.
    """

    entries: list[PublisherActivity] = field(default_factory=list)


@dataclass(slots=True)
class PublisherState:
    """What a member knows of one publisher (one entry of a Catchup)."""

    publisher: str
    last_pub: int
    last_ack: int
    pending_first_seq: int
    pending: list[bytes]


@dataclass(slots=True)
class Catchup:
    """A member's whole state, sent to a new right neighbour.

    `joining` marks the one Catchup a member sends to a newcomer it has just
    added: the only state a newcomer may start from (see the ring's header).
    """

    publishers: list[PublisherState]
    joining: bool = False


@dataclass(slots=True)
class RingMessage:
    """A message from `sender` to its right neighbour `receiver`."""

    group: str
    sender: str
    receiver: str
    view_version: int
    body: Activity | Catchup


# ---------------------------------------------------------------------------
# Actions: what the ring asks its shell to do, in list order.
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SendRight:
    """Send `message` to the member `message.receiver`, hosted on `node`."""

    message: RingMessage
    node: str


@dataclass(frozen=True, slots=True)
class Deliver:
    """Hand consecutive publications of `publisher` to the application."""

    publisher: str
    first_seq: int
    bodies: list[bytes]


@dataclass(frozen=True, slots=True)
class Confirmed:
    """Every live member has delivered this member's publications up to `through_seq`."""

    through_seq: int


@dataclass(frozen=True, slots=True)
class Joined:
    """The member has its starting state; `members` are all it knows of.

    `start_after` gives, per publisher, the last sequence number the member
    will not deliver: its deliveries of that publisher start right after.
    """

    members: tuple[str, ...]
    view_version: int
    start_after: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class MembersChanged:
    """Members new to the view, and members erased from it (nothing in flight)."""

    births: tuple[str, ...]
    deaths: tuple[str, ...]
    view_version: int


@dataclass(frozen=True, slots=True)
class ReadGroup:
    """Read the group table and call `on_group` before any other input."""

    at_least_version: int


@dataclass(frozen=True, slots=True)
class WriteGroup:
    """Apply `change` in the coordinator and call `on_group_written` before any other input.

    `reason` says in words why the member wants the change (for a member
    recorded dead: which neighbour or join target, on which node, and the
    evidence), so the shell can log every death with its cause.
    """

    change: GroupChange
    reason: str


@dataclass(frozen=True, slots=True)
class StartFlushTimer:
    """Call `flush` after the flush interval: the broadcast buffer became non-empty, holding
    `buffered_bytes` (the shell may flush at once: see services/gm/member.py), or, `acks_only`,
    acknowledgements are waiting for a frame to ride on (the shell waits longer than the interval: one
    may go right before it), unless `prompt`: some acknowledge a dead member's publications, whose
    erasure, and the news of its death to the application, waits for them (the flush interval at most)."""

    acks_only: bool = False
    buffered_bytes: int = 0
    prompt: bool = False


@dataclass(frozen=True, slots=True)
class ChooseLeft:
    """Pick one of `candidates` (live members) at random and call `join_via` with it."""

    candidates: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RequestAddOnRight:
    """Ask `left` (on `node`) to add this member right of itself; report with
    `on_join_reply` or `on_join_failed`. The shell keeps asking while `left`'s
    node is silent; only its failure detector (or an answer that `left` is not
    hosted there) may report `left` down."""

    left: str
    node: str


@dataclass(frozen=True, slots=True)
class AddOnRightReply:
    """Answer the newcomer's AddOnRight request: the group, or None if not ready."""

    newcomer: str
    group: Group | None


@dataclass(frozen=True, slots=True)
class WatchNeighbours:
    """Watch these members for failure; report with `on_neighbour_down`."""

    left: str
    left_node: str
    right: str
    right_node: str


@dataclass(frozen=True, slots=True)
class Stopped:
    """The member has stopped (left, lost its membership, or must rejoin)."""

    reason: str
    rejoin: bool = False


Action = (
    SendRight
    | Deliver
    | Confirmed
    | Joined
    | MembersChanged
    | ReadGroup
    | WriteGroup
    | StartFlushTimer
    | ChooseLeft
    | RequestAddOnRight
    | AddOnRightReply
    | WatchNeighbours
    | Stopped
)
