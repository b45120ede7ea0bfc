"""A DRA claim's life on the node: read, prepared, its files, unprepared.

Preparing a claim holds the IOMMU groups of its devices on the node's one
ledger (`ClaimHold`), so a claim can never take a group a device-plugin
allocation holds, nor the other way round; unpreparing frees them at once.
What it prepared is reported as the checkpoint (`ClaimsChanged`) and taken
back at start (`ClaimsRecalled`), so a restarted dp holds the same groups
and an Unprepare for a claim deleted from the API meanwhile still frees its
group.

A Prepare is one call the core drives in steps, each step an effect the
shell carries out and an input it feeds back for the same call:

- `ClaimPrepareRequested`: a claim prepared already is answered from what
  is held, API server or not; any other is asked to be read (`ReadClaim`).
- `ClaimRead` prepares it from its allocation, or refuses it
  (`ClaimRefused`); `ClaimUnreadable` refuses it with the shell's reason. A
  claim another call prepared while this one's was read is answered from
  what is held, read or not.
- `ClaimPrepared` asks for its CDI specs and metadata; `ClaimFilesWritten`
  is answered with `ClaimAnswered`, the devices and their CDI IDs. A claim
  prepared by that call whose files could not be written is released again
  (nothing may stay held for a claim the kubelet is told failed), its files
  removed, and then answered with the error.

Unpreparing likewise: `ClaimUnprepared` (the groups are free at once), the
shell's `ClaimFilesRemoved`, then `ClaimAnswered`. Which input continues
which call is `_WAITS`, and only a call waiting for it may be continued.
Only its report ends a wait, never time: a shell whose call ends before
its claim is read (the kubelet gave up) still feeds `ClaimUnreadable`, and
nobody hears the refusal.

A claim the core cannot prepare (a device it does not offer, another node's
pool, a group held elsewhere, a claim the shell could not read) is the
peer's problem and gets `ClaimRefused` with a message naming what; nothing
held is released. `UsageError` is kept for the shell's mistakes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, Literal

import attrs

from ..errors import UsageError
from ..frontend import Clock, Outcome
from ..ledger import Ledger
from ..log import Log
from .claims import ClaimHold, ClaimRef
from .effects import (
    ClaimAnswered,
    ClaimPrepared,
    ClaimRefused,
    ClaimsChanged,
    ClaimUnprepared,
    DraEffect,
    ReadClaim,
)
from .inputs import (
    ClaimFilesRemoved,
    ClaimFilesWritten,
    ClaimPrepareRequested,
    ClaimRead,
    ClaimsRecalled,
    ClaimUnprepareRequested,
    ClaimUnreadable,
)
from .metadata import prepared_devices
from .offer import Offer, Refusal
from .prepared import PreparedClaim

__all__ = ["ClaimLifecycle"]

Effects = list[DraEffect | Log]
Done = Outcome[DraEffect | Log]

#: What a waiting call waits for: its claim's read, its files written, or removed.
Wait = Literal["read", "written", "removed"]

#: The one rule of which report continues which wait.
_WAITS: dict[type, Wait] = {
    ClaimRead: "read",
    ClaimUnreadable: "read",
    ClaimFilesWritten: "written",
    ClaimFilesRemoved: "removed",
}

_Report = ClaimRead | ClaimUnreadable | ClaimFilesWritten | ClaimFilesRemoved


@attrs.frozen
class _Waiting:
    """A call waiting for the shell's report on its claim."""

    claim: ClaimRef
    wait: Wait
    fresh: bool = False  # prepared by this call: released if its files cannot be written
    error: str = ""  # its answer, decided already (a failed write, its files being removed)


class ClaimLifecycle:
    """The prepared claims of one DRA front end, and the calls waiting on the shell."""

    def __init__(self, ledger: Ledger, offer: Offer, clock: Clock) -> None:
        self._ledger = ledger
        self._offer = offer
        self._clock = clock
        self._prepared: dict[str, PreparedClaim] = {}
        self._waiting: dict[int, _Waiting] = {}  # by call

    def steps(self) -> dict[type, Callable[[Any], Done]]:
        """Its inputs, each with its step (the front end's handlers)."""
        return {
            ClaimPrepareRequested: self._prepare,
            ClaimRead: self._read,
            ClaimUnreadable: self._unreadable,
            ClaimFilesWritten: self._files_written,
            ClaimUnprepareRequested: self._unprepare,
            ClaimFilesRemoved: self._files_removed,
            ClaimsRecalled: self._recalled,
        }

    def prepared(self) -> tuple[PreparedClaim, ...]:
        """Every prepared claim, sorted by UID: the checkpoint."""
        return tuple(self._prepared[uid] for uid in sorted(self._prepared))

    def held(self) -> Collection[PreparedClaim]:
        return self._prepared.values()

    def reads_waiting(self) -> int:
        """Calls that wait for their claim's read."""
        return sum(1 for waiting in self._waiting.values() if waiting.wait == "read")

    # -- Prepare -------------------------------------------------------------------

    def _prepare(self, event: ClaimPrepareRequested) -> Done:
        """A claim prepared already goes to its files; any other is read first."""
        known = self._prepared.get(event.claim.uid)
        if known is not None:
            return self._again(event.call, known)
        self._waiting[event.call] = _Waiting(event.claim, "read")
        return Outcome((ReadClaim(event.call, event.claim),))

    def _read(self, event: ClaimRead) -> Done:
        """The claim as read: hold its groups and ask for its files (`ClaimPrepared`)."""
        claim = self._take(event).claim
        known = self._prepared.get(claim.uid)
        if known is not None:  # another call prepared it while this one's was read
            return self._again(event.call, known)
        try:
            devices = self._offer.claim_devices(event.results)
        except Refusal as refusal:
            return self._refuse(event.call, claim, str(refusal), refusal.reason)
        prepared = PreparedClaim(claim, devices, event.pod_claim_name, event.extended_resources)
        names = tuple(device.name for device in devices)
        hold = ClaimHold(claim, names, prepared.groups)
        self._ledger.hold(hold)
        self._prepared[claim.uid] = prepared
        self._waiting[event.call] = _Waiting(claim, "written", fresh=True)
        effects: Effects = [
            ClaimPrepared(event.call, prepared),
            Log.info(
                "claim-prepared",
                claim=claim.path,
                uid=claim.uid,
                devices=",".join(names),
                groups=",".join(str(g) for g in prepared.groups),
            ),
            ClaimsChanged(self.prepared()),
        ]
        # Its devices are all offered (else it was refused): no device's health changed.
        return Outcome(tuple(effects), prepared.groups)

    def _unreadable(self, event: ClaimUnreadable) -> Done:
        claim = self._take(event).claim
        known = self._prepared.get(claim.uid)
        if known is not None:  # prepared by another call: its read was not needed
            return self._again(event.call, known)
        return self._refuse(event.call, claim, event.problem, "ClaimUnreadable")

    def _again(self, call: int, known: PreparedClaim) -> Done:
        """A claim prepared already: the same answer, once its files are in place."""
        self._waiting[call] = _Waiting(known.claim, "written")
        return Outcome((ClaimPrepared(call, known),))

    def _refuse(self, call: int, claim: ClaimRef, message: str, reason: str) -> Done:
        return Outcome.of(
            [
                ClaimRefused(call, claim, message, reason),
                Log.warning(
                    "claim-refused",
                    claim=claim.path,
                    uid=claim.uid,
                    reason=message,
                ),
            ]
        )

    def _files_written(self, event: ClaimFilesWritten) -> Done:
        """The shell's report on `ClaimPrepared`: the answer, or the claim let go."""
        waiting = self._take(event)
        claim = waiting.claim
        if not event.problem:
            prepared = self._prepared.get(claim.uid)
            if prepared is None:
                # The kubelet unprepared it while its files were written (a
                # shell that writes files while it serves the next call).
                error = f"claim {claim.describe()} was unprepared while its files were written"
                return Outcome((ClaimAnswered(event.call, claim, error=error),))
            devices = prepared_devices(self._offer.driver or "", prepared)
            return Outcome((ClaimAnswered(event.call, claim, devices),))
        error = f"claim {claim.describe()}: its CDI files could not be written: {event.problem}"
        if not waiting.fresh:
            return Outcome((ClaimAnswered(event.call, claim, error=error),))
        # Nothing may stay held for a claim the kubelet is told failed: its
        # files go, and it is answered once they have.
        released = self._release(claim, event.call, self._clock.now)
        self._waiting[event.call] = _Waiting(claim, "removed", error=error)
        return released

    # -- Unprepare -----------------------------------------------------------------

    def _unprepare(self, event: ClaimUnprepareRequested) -> Done:
        """Unprepare one claim, known or not: free its groups, and ask for its
        files to go (`ClaimUnprepared`)."""
        released = self._release(event.claim, event.call, event.now)
        self._waiting[event.call] = _Waiting(event.claim, "removed")
        return released

    def _files_removed(self, event: ClaimFilesRemoved) -> Done:
        """The shell's report on `ClaimUnprepared`: the answer."""
        waiting = self._take(event)
        error = waiting.error
        if not error and event.problem:
            # The group is free already; the kubelet asks again, and the files go then.
            claim = waiting.claim
            error = f"claim {claim.describe()}: its CDI files could not be removed: {event.problem}"
        return Outcome((ClaimAnswered(event.call, waiting.claim, error=error),))

    def _take(self, report: _Report) -> _Waiting:
        """The wait `report` ends; UsageError when its call waits for no such report."""
        call = report.call
        waiting = self._waiting.get(call)
        if waiting is None or waiting.wait != _WAITS[type(report)]:
            what = type(report).__name__
            raise UsageError(f"{what} for call {call}, which waits for no such report")
        del self._waiting[call]
        return waiting

    def _release(self, claim: ClaimRef, call: int, now: float) -> Done:
        """Let `claim` go: its groups at once, its files through `ClaimUnprepared`."""
        hold = self._ledger.holding(ClaimHold.key_of(claim))
        if hold is not None:
            self._ledger.release(hold)
        prepared = self._prepared.pop(claim.uid, None)
        effects: Effects = [ClaimUnprepared(call, claim, prepared)]
        if prepared is None:
            return Outcome(tuple(effects))
        effects += [
            Log.info(
                "claim-unprepared",
                claim=prepared.claim.path,
                uid=claim.uid,
                groups=",".join(str(g) for g in prepared.groups),
            ),
            ClaimsChanged(self.prepared()),
        ]
        if any(self._offer.device(device.name) is None for device in prepared.devices):
            # Held but no longer offered: reported for the claim's sake until now.
            effects.extend(self._offer.health_now(self._prepared.values(), now))
        # Binds put off while the claim held a group may go now.
        return Outcome(tuple(effects), prepared.groups, released=bool(prepared.groups))

    # -- at start ------------------------------------------------------------------

    def _recalled(self, event: ClaimsRecalled) -> Done:
        """Hold again what the checkpoint says was prepared; report groups found held."""
        if self._prepared:
            raise UsageError("ClaimsRecalled after claims were prepared: recall them first")
        effects: Effects = []
        touched: set[int] = set()
        for prepared in event.prepared:
            free = []
            for group in prepared.groups:
                claimant = f"{prepared.describe()} was prepared with it"
                report = self._ledger.split_report(group, claimant)
                if report is None:
                    free.append(group)
                else:
                    effects.append(Log.error("group-split", detail=report))
            names = tuple(device.name for device in prepared.devices)
            hold = ClaimHold(prepared.claim, names, tuple(sorted(set(free))))
            self._ledger.hold(hold)
            self._prepared[prepared.claim.uid] = prepared
            touched.update(free)
        if event.prepared:
            effects.append(Log.info("claims-recalled", claims=len(event.prepared)))
        effects.extend(self._offer.health_now(self._prepared.values(), self._clock.now))
        return Outcome(tuple(effects), touched)
