from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

import go_kubelet
import qemu_guest
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
def gokubelet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The grpc-go kubelet, built once and removed at the end of the run;
    skipped without Go unless DP_REQUIRE_GO_KUBELET=1."""
    why = go_kubelet.missing()
    if why is not None:
        if os.environ.get("DP_REQUIRE_GO_KUBELET") == "1":
            pytest.fail(f"DP_REQUIRE_GO_KUBELET=1 but gokubelet cannot be built: {why}")
        pytest.skip(why)
    directory = tmp_path_factory.mktemp("gokubelet")
    try:
        yield go_kubelet.build(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def guest_python_image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The guests' python image (python3.11, its stdlib, dp), made once per run
    and removed at its end: it is the largest thing the suite makes."""
    qemu_guest.require()
    workdir = tmp_path_factory.mktemp("guest-python")
    try:
        yield qemu_guest.python_image(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
