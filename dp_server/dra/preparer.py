"""What the DRA kubelet service needs of whoever prepares claims (the runtime, or a fake).

The service passes a request's claims to be prepared all at once (a pod's
claims come in one request, and each may need a read from the API server),
and answers each with its own outcome; unprepares go one call each, in the
order the kubelet listed them. Idempotence (a claim prepared twice, or
unprepared when it was never prepared) is the implementor's to decide.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs

from dp_core.dra import ClaimRef, PreparedDevice

__all__ = ["ClaimPreparer", "PrepareFailed", "PrepareOutcome", "Prepared"]


@attrs.frozen
class Prepared:
    """The claim is ready; the container gets `devices`."""

    devices: tuple[PreparedDevice, ...]


@attrs.frozen
class PrepareFailed:
    """The claim could not be prepared; `error` goes to the kubelet as the claim's error."""

    error: str


PrepareOutcome = Prepared | PrepareFailed


class ClaimPreparer(Protocol):
    async def prepare(self, claims: Sequence[ClaimRef]) -> list[PrepareOutcome | Exception]:
        """Prepare each of `claims` (or find it prepared already), and say what
        each got, in their order: its outcome, or what its preparation raised
        (a bug, which the service reports as that claim's internal error)."""

    async def unprepare(self, claim: ClaimRef) -> str | None:
        """Release `claim`; return None when done (or nothing was held), else the error."""
