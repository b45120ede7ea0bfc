from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

import go_kubelet
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


@pytest.fixture(scope="session")
def gokubelet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The grpc-go kubelet, built once; skipped without Go unless DP_REQUIRE_GO_KUBELET=1."""
    why = go_kubelet.missing()
    if why is not None:
        if os.environ.get("DP_REQUIRE_GO_KUBELET") == "1":
            pytest.fail(f"DP_REQUIRE_GO_KUBELET=1 but gokubelet cannot be built: {why}")
        pytest.skip(why)
    return go_kubelet.build(tmp_path_factory.mktemp("gokubelet"))
