"""What the DRA kubelet service needs of whoever prepares claims (the runtime, or a fake).

The service passes a request's claims to be prepared all at once (a pod's
claims come in one request, and each may need a read from the API server),
and answers each with its own outcome; unprepares go one call each, in the
order the kubelet listed them. Idempotence (a claim prepared twice, or
unprepared when it was never prepared) is the implementor's to decide.

An outcome is the core's own answer, as the device-plugin service's is the
core's `Reply` or `Reject`: `ClaimAnswered` (its devices, or the error its
files met) or `ClaimRefused` (why it cannot be prepared here, a claim that
could not be read included). A claim the core never answered (the service
reporting a bug as the claim's internal error) gets a `ClaimRefused` made
here, under call 0 (`refused`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from dp_core.dra import ClaimAnswered, ClaimRef, ClaimRefused

__all__ = ["ClaimPreparer", "PrepareOutcome", "refused"]

PrepareOutcome = ClaimAnswered | ClaimRefused


def refused(claim: ClaimRef, error: str, reason: str) -> ClaimRefused:
    """A refusal the core did not make, under no call of the core's (a bug's)."""
    return ClaimRefused(0, claim, error, reason)


class ClaimPreparer(Protocol):
    async def prepare(self, claims: Sequence[ClaimRef]) -> list[PrepareOutcome | Exception]:
        """Prepare each of `claims` (or find it prepared already), and say what
        each got, in their order: its outcome, or what its preparation raised
        (a bug, which the service reports as that claim's internal error)."""

    async def unprepare(self, claim: ClaimRef) -> str | None:
        """Release `claim`; return None when done (or nothing was held), else the error."""
