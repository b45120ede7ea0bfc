from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest
from hypothesis import HealthCheck, settings

from e2e_harness import Harness

# Shared, noisy CI machines: never fail a property on wall-clock time.
settings.register_profile(
    "dp", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dp"))


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    """A temp dir with the fixture host, for an emulator and a runtime; cleaned up after."""
    h = Harness()
    try:
        yield h
    finally:
        await h.close()
