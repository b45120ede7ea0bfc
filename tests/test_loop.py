"""The loop's core: every effect the core can emit has exactly one handler,
an input that arises while effects run is fed after them (never nested), a
call gets its own answer, and a call the core continues gets its next one."""

from __future__ import annotations

import gc
import typing
from pathlib import Path

import pytest

from dp_core import (
    ClaimPrepareRequested,
    ClaimRef,
    ClaimRefused,
    ClaimUnreadable,
    Config,
    Effect,
    HostObserved,
    HostSnapshot,
    Log,
    OptionsRequested,
    ReadClaim,
    Reject,
    Reply,
    SharedDevice,
    StandardNode,
    Tick,
)
from dp_core.config import Dra
from dp_server.dra.wiring import DraRuntime
from dp_server.loop import CollectionPolicy, Loop
from dp_server.runtime.runtime import Runtime, Settings

KVM = SharedDevice("devices.kubevirt.io/kvm", "/dev/kvm", count=2)


async def test_every_effect_of_the_core_has_exactly_one_handler(short_dir: Path) -> None:
    tmp_path = short_dir
    settings = Settings(
        sysfs=str(tmp_path / "sys"),
        dev=str(tmp_path / "dev"),
        device_plugin_dir=str(tmp_path / "device-plugins"),
        cdi_spec_dir=str(tmp_path / "cdi"),
        state_dir=str(tmp_path / "state"),
        node_name="node-a",
        plugins_registry_dir=str(tmp_path / "plugins_registry"),
        plugins_dir=str(tmp_path / "plugins"),
        kube_api_server="http://127.0.0.1:9",  # never asked: nothing runs
    )
    runtime = Runtime(settings, Config(dra=Dra("vfio.dp.example.com")))
    try:
        kinds = typing.get_args(Effect)
        assert len(kinds) >= 20
        assert [kind.__name__ for kind in kinds if not runtime.loop.handles(kind)] == []
        for kind in kinds:  # and only one
            with pytest.raises(ValueError, match="has a handler already"):
                runtime.loop.on(kind, lambda effect: None)
    finally:
        assert runtime.frontend(DraRuntime) is not None
        await runtime.frontend(DraRuntime).closed()


def _loop(record: typing.Callable[[object], None]) -> Loop:
    loop = Loop(StandardNode(Config(shared_devices=(KVM,))), clock=lambda: 1.0)
    for kind in typing.get_args(Effect):
        if kind not in (Reply, Reject):
            loop.on(kind, record)
    loop.answers(Reply, Reject)
    return loop


def test_an_input_fed_while_effects_run_is_fed_after_them() -> None:
    order: list[str] = []

    def record(effect: object) -> None:
        order.append(type(effect).__name__)
        if isinstance(effect, Log) and "fed" not in order:
            loop.feed(Tick(1.0))  # as a sub-system reporting back does
            order.append("fed")

    loop = _loop(record)
    loop.after_input(lambda: order.append("input done"))
    loop.feed(HostObserved(HostSnapshot(dev_nodes={"/dev/kvm"}), 1.0))
    # The Tick waited for the scan's effects (its logs) to be carried out, then was fed.
    first_done = order.index("input done")
    assert order[:2] == ["Log", "fed"] and set(order[2:first_done]) <= {"Log"}
    assert order[first_done:] == ["input done", "input done"]


def test_a_call_gets_its_own_answer() -> None:
    loop = _loop(lambda effect: None)
    loop.feed(HostObserved(HostSnapshot(dev_nodes={"/dev/kvm"}), 1.0))
    answer = loop.call(lambda call: OptionsRequested(7, call, 1.0))
    assert isinstance(answer, Reject)
    assert "connection 7 is not attributed to any resource" in answer.message
    # A call is answered once: the next one gets its own.
    again = loop.call(lambda call: OptionsRequested(8, call, 1.0))
    assert isinstance(again, Reject) and again.call == answer.call + 1


def test_a_continued_call_is_resumed_under_its_number_and_gets_its_next_answer() -> None:
    loop = Loop(StandardNode(Config(dra=Dra("vfio.dp.example.com")), node_name="node-a"))
    answers = (ReadClaim, ClaimRefused)
    for kind in typing.get_args(Effect):
        if kind not in answers:
            loop.on(kind, lambda effect: None)
    loop.answers(*answers)
    claims = [ClaimRef("vms", f"uid-{i}", f"vm-{i}") for i in range(2)]
    asks = [loop.call(lambda call, c=c: ClaimPrepareRequested(call, c, 1.0)) for c in claims]
    assert asks == [ReadClaim(asks[0].call, claims[0]), ReadClaim(asks[0].call + 1, claims[1])]
    # The second call first: each continues its own call, in any order.
    for ask in reversed(asks):
        answer = loop.resume(ask.call, ClaimUnreadable(ask.call, f"cannot read {ask.claim.name}"))
        assert answer == ClaimRefused(
            ask.call, ask.claim, f"cannot read {ask.claim.name}", "ClaimUnreadable"
        )


def test_a_call_is_neither_made_nor_resumed_while_an_input_is_handled() -> None:
    refused: list[str] = []

    def record(effect: object) -> None:
        if isinstance(effect, Log) and not refused:
            for attempt in (
                lambda: loop.call(lambda call: OptionsRequested(7, call, 1.0)),
                lambda: loop.resume(1, OptionsRequested(7, 1, 1.0)),
            ):
                with pytest.raises(RuntimeError) as error:
                    attempt()
                refused.append(str(error.value))

    loop = _loop(record)
    loop.feed(HostObserved(HostSnapshot(dev_nodes={"/dev/kvm"}), 1.0))
    assert refused == ["a call cannot be made or resumed while an input is being handled"] * 2


def test_lost_connections_are_collected_once_the_registrations_settle() -> None:
    """When they settle is the core's to say, once per storm (`RegistrationsSettled`;
    tests/test_deviceplugin_wiring.py follows one through the wiring)."""
    scheduled: list[tuple[float, typing.Callable[[], None]]] = []
    policy = CollectionPolicy(schedule=lambda delay, call: scheduled.append((delay, call)))
    assert scheduled == []
    policy.registrations_settled()
    assert scheduled == [(1.0, gc.collect)]  # a second later: off the last Register's path
    policy.after_kubelet_left()  # at once, before the kubelet is back
    assert scheduled[1:] == [(0, gc.collect)]


def test_the_host_model_a_rescan_replaced_is_collected_a_second_later() -> None:
    """Not in the rescan's own turn, where it would delay what the rescan
    changed on its way out; once, however many rescans came meanwhile.

    The policy's decisions are recorded, not waited for: when a collection
    ends depends on the machine, which collection is asked for and when
    does not."""
    scheduled: list[tuple[float, typing.Callable[[], None]]] = []
    collections: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "stop":
            collections.append(info["generation"])

    policy = CollectionPolicy(schedule=lambda delay, call: scheduled.append((delay, call)))
    collecting = gc.isenabled()
    gc.disable()  # only the policy's collections
    gc.callbacks.append(seen)
    try:
        policy.after_rescan()  # the first scan: freeze only
        assert scheduled == [] and collections == []
        assert gc.get_freeze_count() > 0
        policy.after_rescan()
        policy.after_rescan()  # one collection for both rescans
        assert [delay for delay, _ in scheduled] == [1.0]
        assert collections == [], "nothing in the rescan's own turn"
        (_, collect), *_ = scheduled
        collect()
        assert collections == [2], "one full collection"
        assert gc.get_freeze_count() > 0, "what survived is frozen again"
        policy.after_rescan()  # the next rescan gets its own
        assert [delay for delay, _ in scheduled] == [1.0, 1.0]
    finally:
        gc.callbacks.remove(seen)
        gc.unfreeze()
        if collecting:
            gc.enable()
