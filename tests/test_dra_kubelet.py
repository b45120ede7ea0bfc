"""The DRA front end's kubelet side against a grpcio kubelet (dp_testing.dra_kubelet).

Registration goes through the plugin watcher's protocol (a socket appears in
the registry directory, GetInfo, NotifyRegistrationStatus); claims go through
NodePrepareResources and NodeUnprepareResources on the version the kubelet
chose. Everything is observed through the sockets, `DraEndpoints`' public
state and the emulator.
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import pytest

from dp_core.dra import ClaimAnswered
from dp_core.dra.claims import ClaimRef, PreparedDevice
from dp_server.dra import (
    DraEndpoints,
    ForeignSocket,
    PrepareOutcome,
    RegistrationStatus,
    refused,
)
from dp_testing.dra_kubelet import (
    Claim,
    Device,
    DraCallError,
    DraKubeletEmulator,
    PrepareResult,
    pick_health_service,
)

DRIVER = "vfio.dp.example.com"


class FakePreparer:
    """Prepares any claim whose name does not start with "bad"; "crash" raises;
    "slow" is never answered, as under an API server that never answers."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ClaimRef]] = []

    async def prepare(self, claims: Sequence[ClaimRef]) -> list[PrepareOutcome | Exception]:
        if any(claim.name == "slow" for claim in claims):
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.calls.extend(("cancelled", claim) for claim in claims)
                raise
        outcomes: list[PrepareOutcome | Exception] = []
        for claim in claims:
            try:
                outcomes.append(self._prepare(claim))
            except RuntimeError as error:
                outcomes.append(error)
        return outcomes

    def _prepare(self, claim: ClaimRef) -> PrepareOutcome:
        self.calls.append(("prepare", claim))
        if claim.name == "crash":
            raise RuntimeError("boom")
        if claim.name.startswith("bad"):
            return refused(claim, f"IOMMU group 7 is held by claim {claim.namespace}/other", "Held")
        return ClaimAnswered(
            0,
            claim,
            (
                PreparedDevice(
                    ("gpu",), "node-a", f"dev-{claim.name}", (f"{DRIVER}/pci={claim.uid}",)
                ),
            ),
        )

    async def unprepare(self, claim: ClaimRef) -> str | None:
        self.calls.append(("unprepare", claim))
        return "cannot release group 7" if claim.name.startswith("bad") else None


@pytest.fixture
def root(short_dir: Path) -> Path:
    return short_dir


def make_endpoints(
    root: Path, preparer: FakePreparer, *, kubelet_dirs: bool = True, **kw: object
) -> DraEndpoints:
    """Endpoints under `root`; with `kubelet_dirs`, the directories a kubelet
    makes at start are there."""
    if kubelet_dirs:
        for kubelets in ("registry", "plugins"):
            (root / kubelets).mkdir(exist_ok=True)
    return DraEndpoints(DRIVER, root / "registry", root / "plugins", preparer, **kw)  # type: ignore[arg-type]


@pytest.fixture
async def served(root: Path) -> AsyncIterator[tuple[DraEndpoints, FakePreparer]]:
    preparer = FakePreparer()
    endpoints = make_endpoints(root, preparer, check_interval=0.05)
    await endpoints.start()
    yield endpoints, preparer
    await endpoints.close()


@pytest.fixture
async def kubelet(root: Path) -> AsyncIterator[DraKubeletEmulator]:
    emulator = DraKubeletEmulator(root / "registry")
    emulator.start()
    yield emulator
    await asyncio.to_thread(emulator.stop)


async def registered(kubelet: DraKubeletEmulator, count: int = 1) -> None:
    await asyncio.to_thread(kubelet.wait_for, "registered", DRIVER, count=count)


async def until(predicate: object, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


# -- registration ----------------------------------------------------------------------


async def test_the_kubelet_registers_the_driver_on_v1(
    root: Path, served: tuple[DraEndpoints, FakePreparer], kubelet: DraKubeletEmulator
) -> None:
    endpoints, _ = served
    await registered(kubelet)
    plugin = kubelet.plugins()[DRIVER]
    dra_sock = root / "plugins" / DRIVER / "dra.sock"
    assert plugin.endpoint == str(dra_sock)
    assert plugin.versions == ("v1.DRAPlugin", "v1beta1.DRAPlugin")
    assert plugin.service == "v1.DRAPlugin"
    assert plugin.socket == str(root / "registry" / f"{DRIVER}-reg.sock")
    (info,) = kubelet.events("info")
    assert info.detail.startswith("type=DRAPlugin ")
    await until(lambda: endpoints.registration_status is not None)
    assert endpoints.registration_status == RegistrationStatus(True, "")
    assert endpoints.ready
    for path in (dra_sock, Path(plugin.socket)):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


async def test_a_kubelet_that_knows_only_v1beta1_picks_it(
    root: Path, served: tuple[DraEndpoints, FakePreparer]
) -> None:
    kubelet = DraKubeletEmulator(root / "registry", supported_services=("v1beta1.DRAPlugin",))
    kubelet.start()
    try:
        await registered(kubelet)
        assert kubelet.plugins()[DRIVER].service == "v1beta1.DRAPlugin"
        result = await asyncio.to_thread(kubelet.prepare, DRIVER, [Claim("ns", "u1", "vm")])
        assert result["u1"].error == ""
        assert result["u1"].devices[0].device_name == "dev-vm"
    finally:
        await asyncio.to_thread(kubelet.stop)


async def test_a_refused_registration_is_recorded_and_not_ready(
    root: Path, served: tuple[DraEndpoints, FakePreparer]
) -> None:
    endpoints, _ = served
    kubelet = DraKubeletEmulator(root / "registry", supported_services=())
    kubelet.start()
    try:
        await asyncio.to_thread(kubelet.wait_for, "rejected", DRIVER)
        await until(lambda: endpoints.registration_status is not None)
        status = endpoints.registration_status
        assert status is not None and not status.registered
        assert "none of services supported by the plugin" in status.error
        assert DRIVER in status.error
        assert not endpoints.ready
        assert kubelet.plugins() == {}
    finally:
        await asyncio.to_thread(kubelet.stop)


# -- claims ----------------------------------------------------------------------------


async def test_each_claim_gets_its_own_answer_and_one_failure_fails_only_itself(
    served: tuple[DraEndpoints, FakePreparer], kubelet: DraKubeletEmulator
) -> None:
    _, preparer = served
    await registered(kubelet)
    claims = [
        Claim("ns", "u-good", "vm-a"),
        Claim("ns", "u-bad", "bad-split"),
        Claim("ns", "u-crash", "crash"),
        Claim("other", "u-good2", "vm-b"),
    ]
    result = await asyncio.to_thread(kubelet.prepare, DRIVER, claims)
    assert set(result) == {"u-good", "u-bad", "u-crash", "u-good2"}
    assert result["u-good"] == PrepareResult(
        (Device(("gpu",), "node-a", "dev-vm-a", (f"{DRIVER}/pci=u-good",)),), ""
    )
    assert result["u-good2"].devices[0].device_name == "dev-vm-b"
    assert result["u-bad"] == PrepareResult((), "IOMMU group 7 is held by claim ns/other")
    assert result["u-crash"].devices == ()
    assert "internal error preparing claim ns/crash: boom" in result["u-crash"].error
    # Passed through in the kubelet's order, each once.
    assert [c.uid for kind, c in preparer.calls] == ["u-good", "u-bad", "u-crash", "u-good2"]
    assert preparer.calls[0] == ("prepare", ClaimRef("ns", "u-good", "vm-a"))

    errors = await asyncio.to_thread(kubelet.unprepare, DRIVER, claims[:2])
    assert errors == {"u-good": "", "u-bad": "cannot release group 7"}
    assert preparer.calls[-2:] == [
        ("unprepare", ClaimRef("ns", "u-good", "vm-a")),
        ("unprepare", ClaimRef("ns", "u-bad", "bad-split")),
    ]


async def test_a_call_the_kubelet_gives_up_on_is_cancelled_in_the_preparer(
    served: tuple[DraEndpoints, FakePreparer], kubelet: DraKubeletEmulator
) -> None:
    """The kubelet's deadline reaches the preparer as its task cancelled, so
    that what it began for the call (the claims' reads, the node's waits for
    them) can end with it."""
    _, preparer = served
    await registered(kubelet)
    kubelet.call_timeout = 0.5
    with pytest.raises(DraCallError) as gave_up:
        await asyncio.to_thread(kubelet.prepare, DRIVER, [Claim("ns", "u-slow", "slow")])
    assert gave_up.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    await until(lambda: ("cancelled", ClaimRef("ns", "u-slow", "slow")) in preparer.calls)


async def test_both_api_versions_are_served_with_the_same_answers(
    served: tuple[DraEndpoints, FakePreparer], kubelet: DraKubeletEmulator
) -> None:
    await registered(kubelet)
    claims = [Claim("ns", "u1", "vm"), Claim("ns", "u2", "bad")]
    answers = {}
    for service in ("v1.DRAPlugin", "v1beta1.DRAPlugin"):
        answers[service] = await asyncio.to_thread(kubelet.prepare, DRIVER, claims, service=service)
        unprepared = await asyncio.to_thread(kubelet.unprepare, DRIVER, claims, service=service)
        assert unprepared == {"u1": "", "u2": "cannot release group 7"}
    assert answers["v1.DRAPlugin"] == answers["v1beta1.DRAPlugin"]
    assert answers["v1.DRAPlugin"]["u1"].devices[0].device_name == "dev-vm"


async def test_an_empty_request_gets_an_empty_reply(
    served: tuple[DraEndpoints, FakePreparer], kubelet: DraKubeletEmulator
) -> None:
    await registered(kubelet)
    assert await asyncio.to_thread(kubelet.prepare, DRIVER, []) == {}
    assert await asyncio.to_thread(kubelet.unprepare, DRIVER, []) == {}


# -- malformed requests ----------------------------------------------------------------


async def test_a_claim_without_uid_or_a_repeated_uid_is_refused_naming_it(
    served: tuple[DraEndpoints, FakePreparer], kubelet: DraKubeletEmulator
) -> None:
    _, preparer = served
    await registered(kubelet)
    with pytest.raises(DraCallError) as missing:
        await asyncio.to_thread(
            kubelet.prepare, DRIVER, [Claim("ns", "u1", "vm"), Claim("ns", "", "nouid")]
        )
    assert missing.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert missing.value.details == "claims[1] (ns/nouid) has no uid"
    with pytest.raises(DraCallError) as repeated:
        await asyncio.to_thread(
            kubelet.unprepare,
            DRIVER,
            [Claim("ns", "u1", "a"), Claim("ns", "u2", "b"), Claim("ns", "u1", "c")],
        )
    assert repeated.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert repeated.value.details == "claims[0] and claims[2] have the same uid 'u1'"
    assert preparer.calls == []


async def test_a_claim_without_name_or_namespace_fails_alone(
    served: tuple[DraEndpoints, FakePreparer], kubelet: DraKubeletEmulator
) -> None:
    _, preparer = served
    await registered(kubelet)
    result = await asyncio.to_thread(
        kubelet.prepare,
        DRIVER,
        [Claim("", "u1", ""), Claim("ns", "u2", "vm"), Claim("ns", "u3", "")],
    )
    assert result["u1"] == PrepareResult((), "claim u1 has no namespace and no name")
    assert result["u3"] == PrepareResult((), "claim u3 has no name")
    assert result["u2"].error == "" and result["u2"].devices
    assert [c.uid for _, c in preparer.calls] == ["u2"]
    errors = await asyncio.to_thread(kubelet.unprepare, DRIVER, [Claim("ns", "u3", "")])
    assert errors == {"u3": "claim u3 has no name"}


@pytest.mark.parametrize("version", ["v1", "v1beta1"])
async def test_undecodable_request_bytes_are_invalid_argument(
    root: Path, served: tuple[DraEndpoints, FakePreparer], version: str
) -> None:
    path = f"/k8s.io.kubelet.pkg.apis.dra.{version}.DRAPlugin/NodePrepareResources"

    def call() -> grpc.RpcError:
        with grpc.insecure_channel(f"unix:{root / 'plugins' / DRIVER / 'dra.sock'}") as ch:
            rpc = ch.unary_unary(path, request_serializer=None, response_deserializer=None)
            try:
                rpc(b"\x0a\xff\xff\xff\xff\x0f", timeout=5)  # claims: a length past the end
            except grpc.RpcError as error:
                return error
        raise AssertionError("a truncated message was accepted")

    error = await asyncio.to_thread(call)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed request" in (error.details() or "")


# -- sockets ---------------------------------------------------------------------------


async def test_a_deleted_registration_socket_is_made_again_and_registered_again(
    root: Path, served: tuple[DraEndpoints, FakePreparer], kubelet: DraKubeletEmulator
) -> None:
    endpoints, _ = served
    await registered(kubelet)
    await until(lambda: endpoints.ready)
    endpoints.registration_socket_path.unlink()
    await asyncio.to_thread(kubelet.wait_for, "deregistered", DRIVER)
    await registered(kubelet, count=2)
    await until(lambda: endpoints.ready)
    result = await asyncio.to_thread(kubelet.prepare, DRIVER, [Claim("ns", "u1", "vm")])
    assert result["u1"].error == ""


async def test_a_deleted_dra_socket_is_made_again_and_calls_reach_it(
    served: tuple[DraEndpoints, FakePreparer], kubelet: DraKubeletEmulator
) -> None:
    endpoints, _ = served
    await registered(kubelet)
    endpoints.dra_socket_path.unlink()
    await until(lambda: endpoints.dra_socket_path.exists())
    await until(lambda: endpoints.ready)
    result = await asyncio.to_thread(kubelet.prepare, DRIVER, [Claim("ns", "u1", "vm")])
    assert result["u1"].error == ""


async def test_a_restarted_kubelet_registers_the_driver_again(
    served: tuple[DraEndpoints, FakePreparer], kubelet: DraKubeletEmulator
) -> None:
    await registered(kubelet)
    await asyncio.to_thread(kubelet.restart)
    await registered(kubelet, count=2)
    assert [e.kind for e in kubelet.events() if e.kind in ("restart", "registered")] == [
        "registered",
        "restart",
        "registered",
    ]
    result = await asyncio.to_thread(kubelet.prepare, DRIVER, [Claim("ns", "u1", "vm")])
    assert result["u1"].error == ""


async def test_close_removes_both_sockets(root: Path) -> None:
    endpoints = make_endpoints(root, FakePreparer())
    await endpoints.start()
    paths = [endpoints.dra_socket_path, endpoints.registration_socket_path]
    assert all(p.is_socket() for p in paths)
    await endpoints.close()
    assert not any(p.exists() for p in paths)


async def test_a_stale_socket_of_ours_is_replaced(root: Path) -> None:
    endpoints = make_endpoints(root, FakePreparer())
    path = endpoints.registration_socket_path
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))  # a socket file nobody listens on, as a crashed dp leaves
    dead.close()
    await endpoints.start()
    try:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect(str(path))  # refused, were the dead socket still there
        probe.close()
    finally:
        await endpoints.close()


async def test_a_live_foreign_socket_or_a_file_is_left_alone(root: Path) -> None:
    endpoints = make_endpoints(root, FakePreparer())
    path = endpoints.registration_socket_path
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(str(path))
    other.listen()
    try:
        with pytest.raises(ForeignSocket, match=f"another process listens on {path}"):
            await endpoints.start()
        assert path.is_socket()
        # The DRA socket made before the refusal is not left behind.
        assert not endpoints.dra_socket_path.exists()
    finally:
        other.close()
    path.unlink()
    path.write_text("not a socket")
    with pytest.raises(ForeignSocket, match="exists and is not a socket"):
        await endpoints.start()
    assert path.read_text() == "not a socket"


def test_a_driver_name_that_cannot_name_a_file_is_refused(root: Path) -> None:
    for bad in ("", "a/b", ".hidden"):
        with pytest.raises(ValueError, match="cannot name a socket file"):
            DraEndpoints(bad, root / "r", root / "p", FakePreparer())
    assert os.listdir(root) == []


async def test_the_kubelet_asks_for_the_health_stream_at_registration_and_again_after_each_end(
    served: tuple[DraEndpoints, FakePreparer], root: Path
) -> None:
    """As the 1.36 kubelet: every registered plugin is asked for its health
    stream, advertised or not, and asked again `health_retry` after it ends.
    These endpoints serve none: each ask is a well-formed UNIMPLEMENTED."""
    retry = 0.2
    emulator = DraKubeletEmulator(root / "registry", health_retry=retry).start()
    try:
        await asyncio.to_thread(emulator.wait_for, "registered", DRIVER)
        opened = await asyncio.to_thread(emulator.wait_for, "health-opened", DRIVER, count=3)
        ended = emulator.events("health-ended")
        # Claims go through on the same connection all along.
        result = await asyncio.to_thread(emulator.prepare, DRIVER, [Claim("ns", "u1", "vm")])
    finally:
        await asyncio.to_thread(emulator.stop)
    assert len(ended) >= 2
    assert all(e.detail.startswith("UNIMPLEMENTED: Method not found") for e in ended), ended
    starts = [e.time for e in opened]
    gaps = [later - earlier for earlier, later in zip(starts, starts[1:], strict=False)]
    assert all(gap >= retry for gap in gaps), gaps
    assert result["u1"].error == ""


async def test_a_137_kubelet_asks_no_health_stream_of_a_plugin_that_advertised_none(
    served: tuple[DraEndpoints, FakePreparer], root: Path
) -> None:
    """As the 1.37 kubelet (`pickHealthService`): endpoints made without a
    health watcher advertise no DRAResourceHealth, so none is asked for,
    while a 1.36 kubelet asks all the same."""
    newer = DraKubeletEmulator(root / "registry", health_retry=0.05, release="1.37").start()
    try:
        await asyncio.to_thread(newer.wait_for, "registered", DRIVER)
        await asyncio.sleep(0.3)  # six retry intervals: a stream would have been asked for
        result = await asyncio.to_thread(newer.prepare, DRIVER, [Claim("ns", "u1", "vm")])
        assert newer.events("health-opened") == []
    finally:
        await asyncio.to_thread(newer.stop)
    assert result["u1"].error == ""
    older = DraKubeletEmulator(root / "registry", health_retry=0.05, release="1.36").start()
    try:
        (opened,) = await asyncio.to_thread(older.wait_for, "health-opened", DRIVER)
    finally:
        await asyncio.to_thread(older.stop)
    assert opened.detail == "v1alpha1.DRAResourceHealth"


@pytest.mark.parametrize(
    ("release", "advertised", "asked"),
    [
        ("1.36", (), "v1alpha1.DRAResourceHealth"),
        ("1.36", ("v1.DRAResourceHealth",), "v1alpha1.DRAResourceHealth"),
        ("1.37", (), ""),
        ("1.37", ("v1beta1.DRAPlugin",), ""),
        ("1.37", ("v1alpha1.DRAResourceHealth",), "v1alpha1.DRAResourceHealth"),
        ("1.37", ("v1.DRAResourceHealth",), "v1.DRAResourceHealth"),
        ("1.37", ("v1alpha1.DRAResourceHealth", "v1.DRAResourceHealth"), "v1.DRAResourceHealth"),
    ],
)
def test_which_health_stream_a_kubelet_asks_for(
    release: str, advertised: tuple[str, ...], asked: str
) -> None:
    """The kubelet's choice (1.36: dra_plugin_manager.go's `add`; 1.37:
    `pickHealthService` and its table test)."""
    assert pick_health_service(release, advertised) == asked


def test_an_unmodelled_kubelet_release_is_refused(root: Path) -> None:
    with pytest.raises(ValueError, match=r"no kubelet release '1\.35' is modelled"):
        DraKubeletEmulator(root / "registry", release="1.35")


async def test_until_the_kubelet_makes_its_directories_dp_waits_and_makes_only_its_own(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The plugins and plugin-registry directories are the kubelet's (it makes
    them at start); dp says what it waits for, and listens once they are
    there, making only the driver's own directory."""
    endpoints = make_endpoints(root, FakePreparer(), kubelet_dirs=False)
    try:
        await endpoints.start()
        assert endpoints.waiting
        assert not (root / "registry").exists() and not (root / "plugins").exists()
        (waiting,) = [r for r in caplog.records if r.getMessage() == "dra-waiting-for-kubelet"]
        assert "does not exist: it is the kubelet's" in waiting.dp_fields["reason"]  # type: ignore[attr-defined]
        await endpoints.restore()  # a socket check meanwhile makes nothing either
        assert not (root / "plugins").exists()

        (root / "plugins").mkdir()
        await asyncio.sleep(1.5)
        assert endpoints.waiting  # the registry is still missing
        assert not (root / "registry").exists()
        kubelet = DraKubeletEmulator(root / "registry", plugins_dir=root / "plugins").start()
        try:
            await registered(kubelet)
            assert not endpoints.waiting
            assert endpoints.dra_socket_path.is_socket()
            assert endpoints.registration_socket_path.is_socket()
        finally:
            await asyncio.to_thread(kubelet.stop)
    finally:
        await endpoints.close()
