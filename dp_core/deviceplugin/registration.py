"""Registration and one-socket attribution (docs/design.md §4).

The kubelet never names the resource on a plugin connection, so a connection
is attributed by timing: while `Register(X)` is in flight (or, for kubelets
that dial after replying, just after it), the first RPC on a connection the
server has not seen binds that connection to X. Registrations therefore run
one at a time on the shared socket. In per-resource mode every resource has
its own socket, connections are attributed when accepted, and resources
register concurrently.

The phases and the table of their changes are in `phases`; the `Registrar`
changes a phase only through it (`_move`), and nothing else assigns one.
`Phase`, `Step` and `ResourceRegistration` are re-exported here.
"""

from __future__ import annotations

import enum

from ..errors import UsageError
from ..timing import Backoff
from .phases import Phase, ResourceRegistration, Step, next_phase

__all__ = [
    "OPTIONS_CALL",
    "Phase",
    "Registrar",
    "ResourceRegistration",
    "SocketMode",
    "Step",
]


class SocketMode(enum.Enum):
    SINGLE = "single"
    PER_RESOURCE = "per-resource"


OPTIONS_CALL = "GetDevicePluginOptions"


class Registrar:
    """Which resource to register next, and which resource owns a connection."""

    def __init__(
        self,
        mode: SocketMode,
        *,
        dial_wait: float = 3.0,
        held_client_wait: float = 0.2,
        late_dial_wait: float = 10.0,
        backoff: Backoff | None = None,
    ) -> None:
        self.mode = mode
        self.dial_wait = dial_wait
        self.held_client_wait = held_client_wait
        self.late_dial_wait = late_dial_wait
        self.backoff = backoff or Backoff()
        self.kubelet_present = False
        self._resources: dict[str, ResourceRegistration] = {}
        # The same registrations by phase, kept by `_move`: the per-RPC questions
        # (who awaits a connection, what is due, the next deadline) then look at
        # the few resources not live instead of walking every resource.
        self._in_phase: dict[Phase, dict[str, ResourceRegistration]] = {p: {} for p in Phase}
        self._rank: dict[str, int] = {}
        self._owner: dict[int, str | None] = {}  # connection -> resource (None: unattributed)
        # Attempts from before a kubelet restart whose call has not ended yet
        # and whose connection was never seen (single-socket mode waits them out).
        self._stale_unbound: set[int] = set()
        # Until then the shared socket starts no Register: one timed out with
        # no dial seen, and a kubelet that handles it late dials within its
        # dial timeout (10 s) of starting to; that connection must find no
        # Register in flight to be taken for.
        self._quiet_until = 0.0
        self._attempts = 0
        # Learned anew from each kubelet. One that opens a registration's
        # connection inside Register with GetDevicePluginOptions (1.25 and
        # later) opens every one that way. A new connection whose first call
        # is anything else is then grpc-go reconnecting a connection it lost
        # (say a resource's ListAndWatch, after its first connection closed
        # before the Register reply), and binding it to the Register in flight
        # would serve one resource's devices to another. Kubelets that dial
        # after replying, or without that call, never teach it. Such a kubelet
        # also never dials after its reply: one that replies without dialling
        # still holds a client for the name (see `succeeded`).
        self.opens_with_options = False
        # A registration waiting for its dial after the reply saw that dial
        # refused by that rule: a new connection opening with ListAndWatch,
        # as kubelets that dial after replying do. If it then waits in vain,
        # the rule was taught wrongly (another client's stray
        # GetDevicePluginOptions) and is unlearned.
        self._dial_refused = False
        # The attempt counter when each connection opened: a connection is
        # never the dial of a Register that started after it opened.
        self._opened_at: dict[int, int] = {}

    # -- resources -------------------------------------------------------

    def track(self, names: list[str] | tuple[str, ...], now: float) -> list[str]:
        """Start tracking new resource names; returns the ones that were new."""
        added = [name for name in names if name not in self._resources]
        for name in added:
            reg = self._resources[name] = ResourceRegistration(name, next_attempt_at=now)
            self._in_phase[reg.phase][name] = reg
            self._rank[name] = len(self._rank)
        return added

    @property
    def quiet_until(self) -> float:
        """No Register starts on the shared socket before this (see `failed`)."""
        return self._quiet_until

    def get(self, name: str) -> ResourceRegistration:
        try:
            return self._resources[name]
        except KeyError:
            raise UsageError(f"resource {name!r} is not tracked") from None

    def settled(self) -> bool:
        """Every resource is registered and has its connection."""
        return len(self._in_phase[Phase.LIVE]) == len(self._resources)

    def phases(self) -> dict[str, Phase]:
        return {name: reg.phase for name, reg in self._resources.items()}

    def _move(self, reg: ResourceRegistration, step: Step) -> None:
        phase = next_phase(reg.name, reg.phase, step)
        if phase is not reg.phase:
            del self._in_phase[reg.phase][reg.name]
            self._in_phase[phase][reg.name] = reg
            reg.phase = phase

    def _phase_members(self, phase: Phase) -> list[ResourceRegistration]:
        """The registrations in `phase`, in tracking order (a copy: callers move them)."""
        return sorted(self._in_phase[phase].values(), key=lambda reg: self._rank[reg.name])

    # -- registration attempts -------------------------------------------

    def awaiting_attribution(self) -> list[ResourceRegistration]:
        """Registrations a new connection could belong to: at most one in single mode.

        A Register whose connection is already bound no longer counts: the
        kubelet opens one connection per Register, so the next new connection
        belongs to the next registration, which may therefore start while the
        bound one's reply is still on its way.
        """
        registering = self._in_phase[Phase.REGISTERING].values()
        pending = [*self._in_phase[Phase.AWAITING_DIAL].values()]
        pending += [reg for reg in registering if not reg.bound_this_attempt]
        pending.sort(key=lambda reg: self._rank[reg.name])
        return pending

    def in_flight(self) -> ResourceRegistration | None:
        pending = self.awaiting_attribution()
        return pending[0] if pending else None

    def due(self, now: float) -> list[ResourceRegistration]:
        """Resources whose Register call should start now."""
        # Asked after every input: most find nothing waiting to register.
        if not self.kubelet_present or not self._in_phase[Phase.WAITING]:
            return []
        single = self.mode is SocketMode.SINGLE
        if single and (
            self._stale_unbound or now < self._quiet_until or self.in_flight() is not None
        ):
            return []
        waiting = sorted(
            self._in_phase[Phase.WAITING].values(), key=lambda r: (r.next_attempt_at, r.name)
        )
        ready = [r for r in waiting if r.next_attempt_at <= now]
        return ready[:1] if single else ready

    def start(self, reg: ResourceRegistration) -> int:
        self._attempts += 1
        reg.attempt = self._attempts
        reg.bound_this_attempt = False
        self._move(reg, Step.START)
        return reg.attempt

    def succeeded(self, name: str, attempt: int, now: float) -> bool:
        """Record a Register reply; False when it belongs to a stale attempt."""
        self._stale_unbound.discard(attempt)
        reg = self._resources.get(name)
        if reg is None or reg.attempt != attempt or reg.phase is not Phase.REGISTERING:
            return False
        if reg.bound_this_attempt or self.mode is SocketMode.PER_RESOURCE and reg.connections:
            self._move(reg, Step.SUCCEEDED_BOUND)
            reg.live_since = now
            reg.held_replies = 0  # the kubelet dialled: the client it held is gone
            if not reg.connections:
                # The kubelet dialled during Register, but that connection closed
                # before the reply arrived: nothing serves the resource, and the
                # kubelet never redials, so it must register again.
                self._lose(reg, now)
        else:
            self._move(reg, Step.SUCCEEDED_UNBOUND)
            # A reply before any dial does not unlearn the rule: kubelets from
            # 1.26 reply at once, without dialling, while they still hold a
            # client for the name ("already connected"). Here that client's
            # connection has closed (which is why this Register was sent) and
            # the kubelet drops it as soon as it notices, within milliseconds:
            # waiting for a dial that will not come would leave the resource
            # unserved, and single-socket registration stalled, for seconds.
            # The short wait is for a kubelet that dials after replying and
            # was taught the rule by another client's stray call; after two
            # such replies in a row it gets the full wait, in which a refused
            # dial unlearns the rule (see `expire`).
            held = self.opens_with_options and reg.connected and reg.held_replies < 2
            reg.held_wait = held
            reg.held_replies += held
            reg.dial_deadline = now + (self.held_client_wait if held else self.dial_wait)
        return True

    def failed(self, name: str, attempt: int, now: float, *, unanswered: bool = False) -> bool:
        stale = attempt in self._stale_unbound
        self._stale_unbound.discard(attempt)
        reg = self._resources.get(name)
        if (
            unanswered
            and self.mode is SocketMode.SINGLE
            and (
                stale
                or reg is not None
                and reg.attempt == attempt
                and reg.phase is Phase.REGISTERING
                and not reg.bound_this_attempt
            )
        ):
            self._quiet_until = max(self._quiet_until, now + self.late_dial_wait)
        if reg is None or reg.attempt != attempt or reg.phase is not Phase.REGISTERING:
            return False
        self._move(reg, Step.FAILED)
        reg.failures += 1
        reg.next_attempt_at = now + self.backoff.delay(reg.failures)
        return True

    # -- connections -----------------------------------------------------

    def opened(self, connection: int, listener: str | None, now: float) -> None:
        self._owner[connection] = None
        self._opened_at[connection] = self._attempts
        if listener is not None:
            self.bind(connection, listener, now)

    def owner(self, connection: int) -> str | None:
        return self._owner.get(connection)

    def attribute(self, connection: int, now: float, *, rpc: str) -> str | None:
        """The resource an RPC on `connection` is for, binding it if it is new.

        `rpc` is the method's name. Returns None when nothing can own the
        connection (`opens_a_registration` says whether the call ruled it
        out); the caller rejects the RPC and `orphan_seen` schedules
        re-registration.
        """
        owner = self._owner.get(connection)
        if owner is not None:
            if rpc == OPTIONS_CALL:
                # Per-resource mode binds connections when accepted; the
                # kubelet's kind shows in its calls all the same.
                reg = self._resources.get(owner)
                if reg is not None and reg.phase is Phase.REGISTERING:
                    self.opens_with_options = reg.connected = True
            return owner
        if self.mode is not SocketMode.SINGLE:
            return None
        pending = self.in_flight()
        if pending is None or self.opened_before(connection, pending):
            return None
        if not self.opens_a_registration(rpc):
            # During a short wait for a held client's registration, a refused
            # ListAndWatch is another resource's reconnection, not its dial.
            if rpc == "ListAndWatch" and pending.phase is Phase.AWAITING_DIAL:
                self._dial_refused |= not pending.held_wait
            return None
        if rpc == OPTIONS_CALL and pending.phase is Phase.REGISTERING:
            self.opens_with_options = pending.connected = True
            self._dial_refused = False
        self.bind(connection, pending.name, now)
        return pending.name

    def why_unattributed(self, connection: int, rpc: str) -> str:
        """Why `attribute` found no resource for `connection` opening with `rpc`."""
        if self.mode is not SocketMode.SINGLE:
            return "it came in on no resource's socket"
        pending = self.in_flight()
        if pending is None:
            return "no Register call was in flight when it arrived"
        if self.opened_before(connection, pending):
            return f"it was open before {pending.name}'s Register started, so is not its dial"
        return (
            f"it opened with {rpc}, and this kubelet opens a registration's connection with "
            f"{OPTIONS_CALL}: a reconnection of a lost connection, not the dial of "
            f"{pending.name}'s Register"
        )

    def opened_before(self, connection: int, reg: ResourceRegistration) -> bool:
        """Whether `connection` was open before `reg`'s Register started (so is not its dial)."""
        return reg.attempt > self._opened_at.get(connection, -1)

    def opens_a_registration(self, rpc: str) -> bool:
        """Whether the kubelet could open a registration's connection with `rpc`.

        Once it is known to open them with GetDevicePluginOptions, any other
        first call is grpc-go reconnecting a connection it lost. A kubelet
        that dials after replying (1.24 and earlier) may open with
        ListAndWatch, or even with an Allocate for devices it still lists
        from the resource's previous registration.
        """
        return rpc == OPTIONS_CALL or not self.opens_with_options

    def bind(self, connection: int, name: str, now: float) -> None:
        reg = self.get(name)
        self._owner[connection] = name
        reg.connections.add(connection)
        reg.bound_this_attempt = True
        self._move(reg, Step.BOUND)
        if reg.phase is Phase.LIVE:
            reg.dial_deadline = None
            reg.held_replies = 0
            reg.held_wait = False
            if reg.live_since is None:
                reg.live_since = now

    def orphan_seen(self, now: float) -> list[str]:
        """An unattributable connection appeared: re-register the unbound."""
        requeued = []
        for reg in self._phase_members(Phase.UNBOUND):
            self._move(reg, Step.ORPHAN_SEEN)
            reg.next_attempt_at = now
            requeued.append(reg.name)
        return requeued

    def closed(self, connection: int, now: float) -> str | None:
        """Forget a connection; returns the resource that lost its last one."""
        self._opened_at.pop(connection, None)
        name = self._owner.pop(connection, None)
        if name is None:
            return None
        reg = self._resources.get(name)
        if reg is None:
            return None
        reg.connections.discard(connection)
        if reg.connections or reg.phase not in (Phase.LIVE, Phase.UNBOUND, Phase.AWAITING_DIAL):
            return None
        self._lose(reg, now)
        return name

    def _lose(self, reg: ResourceRegistration, now: float) -> None:
        """The resource's last connection is gone: register again, backing off if flapping."""
        if reg.live_since is not None and now - reg.live_since >= self.backoff.healthy_after:
            reg.failures = 0
        self._move(reg, Step.LOST)
        reg.failures += 1
        reg.live_since = None
        reg.next_attempt_at = now + self.backoff.delay(reg.failures - 1)

    # -- kubelet life cycle and timers -------------------------------------

    def kubelet_started(self, now: float) -> None:
        """Every resource registers again at once; old connections are dead."""
        self.kubelet_present = True
        self.opens_with_options = self._dial_refused = False
        self._quiet_until = 0.0  # the old kubelet's late handlers died with it
        # `_opened_at` stays: a connection from before the restart must not be
        # taken for the dial of a Register that starts after it.
        self._owner.clear()
        for reg in self._resources.values():
            if reg.phase is Phase.REGISTERING and not reg.bound_this_attempt:
                # Its Register call may still reach the new kubelet and make it
                # dial; until that call ends, a new connection could be its.
                self._stale_unbound.add(reg.attempt)
            reg.connections.clear()
            reg.connected = reg.held_wait = False
            reg.held_replies = 0
            if reg.phase is not Phase.WAITING:
                self._move(reg, Step.LOST)
            reg.failures = 0
            reg.live_since = None
            reg.dial_deadline = None
            reg.next_attempt_at = now

    def kubelet_stopped(self) -> None:
        self.kubelet_present = False

    def expire(self, now: float) -> list[str]:
        """Apply dial timeouts; returns resources that gave up waiting.

        An unbound resource waits for a late dial's RPC (`orphan_seen`) for
        another `dial_wait`, longer after each miss; if none comes, say the
        kubelet's connection closed before its first RPC, it registers again
        rather than stay unserved.
        """
        expired: list[str] = []
        if not self._in_phase[Phase.AWAITING_DIAL] and not self._in_phase[Phase.UNBOUND]:
            return expired  # the common case, after every input: nothing to expire
        for reg in self._phase_members(Phase.AWAITING_DIAL):
            if reg.dial_deadline is not None and now >= reg.dial_deadline:
                if self._dial_refused and not reg.held_wait:
                    self.opens_with_options = self._dial_refused = False
                self._move(reg, Step.DIAL_TIMEOUT)
                reg.dial_deadline = None
                reg.failures += 1
                # A held client's registration has no late dial to wait for.
                late_dial_wait = 0.0 if reg.held_wait else self.dial_wait
                reg.held_wait = False
                reg.next_attempt_at = now + late_dial_wait + self.backoff.delay(reg.failures)
                expired.append(reg.name)
        for reg in self._phase_members(Phase.UNBOUND):
            if now >= reg.next_attempt_at:
                self._move(reg, Step.RETRY)
        return expired

    def next_deadline(self) -> float | None:
        deadlines = [
            reg.dial_deadline
            for reg in self._in_phase[Phase.AWAITING_DIAL].values()
            if reg.dial_deadline is not None
        ]
        deadlines += [reg.next_attempt_at for reg in self._in_phase[Phase.UNBOUND].values()]
        blocked = self.in_flight() is not None or bool(self._stale_unbound)
        if self.kubelet_present and (self.mode is SocketMode.PER_RESOURCE or not blocked):
            deadlines += [
                max(reg.next_attempt_at, self._quiet_until)
                for reg in self._in_phase[Phase.WAITING].values()
            ]
        return min(deadlines) if deadlines else None
