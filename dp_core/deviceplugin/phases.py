"""A resource's registration phases and the one table of their changes
(docs/design.md §4).

A resource registers with the kubelet, waits for the connection the kubelet
dials back, and is live while it has one; `TRANSITIONS` lists every (phase,
step) -> phase change, and `next_phase` is the only way to take one, so a step
a phase does not expect is a `UsageError` rather than a silent state.
`ResourceRegistration` is one resource's record, which the `Registrar`
(`registration`) keeps.
"""

from __future__ import annotations

import enum

import attrs

from ..errors import UsageError

__all__ = [
    "TRANSITIONS",
    "Phase",
    "ResourceRegistration",
    "Step",
    "next_phase",
]


class Phase(enum.Enum):
    WAITING = "waiting"  # needs a Register call, at or after `next_attempt_at`
    REGISTERING = "registering"  # Register call in flight
    AWAITING_DIAL = "awaiting-dial"  # Register returned, no connection yet (old kubelet)
    UNBOUND = "unbound"  # registered, but no connection could be attributed
    LIVE = "live"  # registered and at least one connection bound


class Step(enum.Enum):
    START = "start"
    SUCCEEDED_BOUND = "succeeded-bound"
    SUCCEEDED_UNBOUND = "succeeded-unbound"
    FAILED = "failed"
    BOUND = "bound"
    DIAL_TIMEOUT = "dial-timeout"
    LOST = "lost"  # last connection closed, or the kubelet restarted
    ORPHAN_SEEN = "orphan-seen"  # an unattributable connection shows up
    RETRY = "retry"  # unbound for long enough: nothing will come, register again


TRANSITIONS: dict[tuple[Phase, Step], Phase] = {
    (Phase.WAITING, Step.START): Phase.REGISTERING,
    (Phase.REGISTERING, Step.SUCCEEDED_BOUND): Phase.LIVE,
    (Phase.REGISTERING, Step.SUCCEEDED_UNBOUND): Phase.AWAITING_DIAL,
    (Phase.REGISTERING, Step.FAILED): Phase.WAITING,
    (Phase.REGISTERING, Step.BOUND): Phase.REGISTERING,
    (Phase.REGISTERING, Step.LOST): Phase.WAITING,
    (Phase.AWAITING_DIAL, Step.BOUND): Phase.LIVE,
    (Phase.AWAITING_DIAL, Step.DIAL_TIMEOUT): Phase.UNBOUND,
    (Phase.AWAITING_DIAL, Step.LOST): Phase.WAITING,
    (Phase.UNBOUND, Step.BOUND): Phase.LIVE,
    (Phase.UNBOUND, Step.ORPHAN_SEEN): Phase.WAITING,
    (Phase.UNBOUND, Step.RETRY): Phase.WAITING,
    (Phase.UNBOUND, Step.LOST): Phase.WAITING,
    (Phase.LIVE, Step.BOUND): Phase.LIVE,
    (Phase.LIVE, Step.LOST): Phase.WAITING,
    (Phase.WAITING, Step.LOST): Phase.WAITING,
    (Phase.WAITING, Step.BOUND): Phase.WAITING,
}


@attrs.define
class ResourceRegistration:
    name: str
    phase: Phase = Phase.WAITING
    next_attempt_at: float = 0.0
    failures: int = 0
    attempt: int = 0
    dial_deadline: float | None = None
    live_since: float | None = None
    connections: set[int] = attrs.field(factory=set)
    bound_this_attempt: bool = False
    # The current kubelet connected to it through the options handshake, so
    # may still hold a client for it; reset when the kubelet restarts.
    connected: bool = False
    # Replies without a dial in a row taken for such a held client, and
    # whether the present wait for a dial is one of them.
    held_replies: int = 0
    held_wait: bool = False


def next_phase(name: str, phase: Phase, step: Step) -> Phase:
    """The phase `step` takes resource `name` to from `phase`, by `TRANSITIONS`."""
    try:
        return TRANSITIONS[(phase, step)]
    except KeyError:
        raise UsageError(f"{name}: no transition from {phase.value} on {step.value}") from None
