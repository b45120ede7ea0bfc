from __future__ import annotations

import logging
import os
import shutil
import tempfile
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


@pytest.fixture(autouse=True)
def _root_logger_as_it_was() -> Iterator[None]:
    """A test that runs the CLI's `main` sets the root logger up as the CLI
    does (`scan` at error level, its own handler); the next test's caplog
    must not inherit that."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    root.setLevel(level)
    # pytest's own handlers stay; a stdlib one the test added goes.
    added = [h for h in root.handlers if h not in handlers and type(h).__module__ == "logging"]
    for handler in added:
        root.removeHandler(handler)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A fresh directory short enough for unix socket paths (108 bytes on Linux),
    which pytest's tmp_path is not; removed after the test."""
    path = Path(tempfile.mkdtemp(prefix="dp-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# --- nothing left behind -------------------------------------------------------------

# The run's own temp dir: every test, and every process a test starts (they
# inherit TMPDIR), makes its temporary files under it, so what is left there
# at the end was left by a test, whatever else the machine runs meanwhile. It
# is short, as unix socket paths are (108 bytes), and removed at the end.
_RUN_TEMP: list[Path] = []


def _left_in(root: Path) -> list[str]:
    # pytest's own base directory (pytest-of-<user>) holds tmp_path trees.
    return sorted(name for name in os.listdir(root) if not name.startswith("pytest-of-"))


def pytest_sessionstart(session: pytest.Session) -> None:
    root = Path(tempfile.mkdtemp(prefix="dpt"))
    _RUN_TEMP.append(root)
    os.environ["TMPDIR"] = str(root)
    tempfile.tempdir = str(root)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if a test left something in the temp dir (tests clean what they make)."""
    if not _RUN_TEMP:
        return
    root = _RUN_TEMP.pop()
    left = _left_in(root)
    if left:
        print(f"\nFAILED: the tests left behind in {root}: {', '.join(left[:10])}")
        if session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    shutil.rmtree(root, ignore_errors=True)


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
