"""What the DRA kubelet service needs of whoever prepares claims (the runtime, or a fake).

The service passes each claim of a request through, one call each, in the
order the kubelet listed them; idempotence (a claim prepared twice, or
unprepared when it was never prepared) is the implementor's to decide.
"""

from __future__ import annotations

from typing import Protocol

import attrs

from dp_core.dra.claims import ClaimRef, PreparedDevice

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
    async def prepare(self, claim: ClaimRef) -> PrepareOutcome:
        """Prepare `claim` (or find it prepared already) and say what it got."""

    async def unprepare(self, claim: ClaimRef) -> str | None:
        """Release `claim`; return None when done (or nothing was held), else the error."""
