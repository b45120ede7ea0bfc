"""Registration and one-socket attribution (docs/design.md §3, §4).

First the `Registrar` alone, as a table of event scripts and the phases they
end in; then the same behaviour through `Node`, as inputs and the effects
they produce.
"""

from __future__ import annotations

import attrs
import pytest

from dp_core import (
    AllocationsObserved,
    AttributeConnection,
    Backoff,
    Config,
    ConfigApplied,
    ConnectionClosed,
    ConnectionOpened,
    EndStream,
    HostObserved,
    HostSnapshot,
    KubeletStarted,
    KubeletStopped,
    Log,
    OptionsRequested,
    Phase,
    PluginOptions,
    Publish,
    RefreshAllocations,
    Register,
    RegistrationFailed,
    RegistrationsSettled,
    RegistrationSucceeded,
    Reject,
    Reply,
    SharedDevice,
    SocketMode,
    StandardNode,
    StatusCode,
    Tick,
    Timing,
    UsageError,
    WatchStarted,
    endpoint_name,
    min_endpoint_length,
)
from dp_core.deviceplugin.registration import Registrar

from core_builders import (
    GPU_RESOURCE,
    VF_RESOURCE,
    effects_of,
    gpu_config,
    one,
    started_node,
    two_gpus_and_vfs,
    without_logs,
)

# ---------------------------------------------------------------------------
# Registrar: scripts of events -> phases


RPC_VERBS = {"rpc": "GetDevicePluginOptions", "watch": "ListAndWatch", "alloc": "Allocate"}


class Script:
    """Runs steps on a Registrar tracking resources "a", "b", "c".

    A step is `verb[:arg,arg][@now]`; after each, due registrations start.
    `rpc:N` is GetDevicePluginOptions on connection N, `watch:N` ListAndWatch,
    `alloc:N` Allocate.
    """

    def __init__(self, mode: SocketMode, names: tuple[str, ...] = ("a", "b", "c")) -> None:
        self.registrar = Registrar(mode, dial_wait=3.0, backoff=Backoff(0.1, 5.0, 10.0))
        self.registrar.track(names, 0.0)
        self.started: list[str] = []
        self.attributed: list[str | None] = []

    def run(self, steps: str) -> Script:
        for step in steps.split():
            step, _, at = step.partition("@")
            verb, _, rest = step.partition(":")
            args = rest.split(",") if rest else []
            now = float(at) if at else 0.0
            self.apply(verb, args, now)
            self.start_due(now)
        return self

    def apply(self, verb: str, args: list[str], now: float) -> None:
        r = self.registrar
        if verb == "kubelet":
            r.kubelet_started(now)
        elif verb == "stopped":
            r.kubelet_stopped()
        elif verb == "ok":
            assert r.succeeded(args[0], r.get(args[0]).attempt, now)
        elif verb == "fail":
            assert r.failed(args[0], r.get(args[0]).attempt, now)
        elif verb == "timeout":  # the call ended without the kubelet's answer
            assert r.failed(args[0], r.get(args[0]).attempt, now, unanswered=True)
        elif verb == "end":  # a stale call ends: nothing to record but that it ended
            assert not r.failed(args[0], r.get(args[0]).attempt, now)
        elif verb == "open":
            r.opened(int(args[0]), args[1] if len(args) > 1 else None, now)
        elif verb in RPC_VERBS:
            self.attributed.append(r.attribute(int(args[0]), now, rpc=RPC_VERBS[verb]))
        elif verb == "orphan":
            r.orphan_seen(now)
        elif verb == "close":
            r.closed(int(args[0]), now)
        elif verb == "tick":
            r.expire(now)
        else:
            raise AssertionError(f"unknown step {verb}")

    def start_due(self, now: float) -> None:
        for reg in self.registrar.due(now):
            self.registrar.start(reg)
            self.started.append(reg.name)

    def phases(self) -> str:
        return " ".join(f"{n}={p.value}" for n, p in sorted(self.registrar.phases().items()))


# a, b and c registered, each through its own options call (a 1.25+ kubelet).
LIVE_ABC = "kubelet open:1 rpc:1 ok:a open:2 rpc:2 ok:b open:3 rpc:3 ok:c "

SINGLE_SCRIPTS = [
    pytest.param("", "a=waiting b=waiting c=waiting", [], id="nothing-before-kubelet"),
    pytest.param("kubelet", "a=registering b=waiting c=waiting", ["a"], id="one-at-a-time"),
    pytest.param("kubelet open:1 rpc:1", "a=registering b=registering c=waiting", ["a", "b"],
                 id="once-bound-the-next-starts-before-the-reply"),
    pytest.param("kubelet open:1 rpc:1 ok:a", "a=live b=registering c=waiting", ["a", "b"],
                 id="modern-kubelet-next-after-reply"),
    pytest.param("kubelet ok:a", "a=awaiting-dial b=waiting c=waiting", ["a"],
                 id="old-kubelet-waits-for-dial"),
    pytest.param("kubelet ok:a open:1 watch:1", "a=live b=registering c=waiting", ["a", "b"],
                 id="old-kubelet-dial-binds-then-next"),
    pytest.param("kubelet ok:a tick@2.9", "a=awaiting-dial b=waiting c=waiting", ["a"],
                 id="dial-wait-not-over"),
    pytest.param("kubelet ok:a tick@3.0", "a=unbound b=registering c=waiting", ["a", "b"],
                 id="dial-timeout-unbound-then-next"),
    pytest.param("kubelet ok:a tick@3 open:9@3.5 watch:9@3.5",
                 "a=unbound b=registering c=registering", ["a", "b", "c"],
                 id="late-dial-after-timeout-goes-to-the-next-in-flight"),
    pytest.param("kubelet fail:a@1", "a=waiting b=registering c=waiting", ["a", "b"],
                 id="failure-lets-others-go-first"),
    pytest.param("kubelet open:1 rpc:1 ok:a close:1@1", "a=waiting b=registering c=waiting",
                 ["a", "b"], id="close-requeues-but-waits-for-b-in-flight"),
    pytest.param("kubelet open:1 rpc:1 ok:a close:1@1 open:2@1 rpc:2@1 ok:b@1",
                 "a=waiting b=live c=registering", ["a", "b", "c"],
                 id="longest-waiting-goes-first"),
    pytest.param("kubelet open:1 rpc:1 ok:a open:2 rpc:2 ok:b close:1@1",
                 "a=waiting b=live c=registering", ["a", "b", "c"],
                 id="close-waits-while-c-in-flight"),
    pytest.param("kubelet open:1 rpc:1 ok:a kubelet@1", "a=waiting b=waiting c=waiting",
                 ["a", "b"], id="restart-waits-for-the-unbound-call"),
    pytest.param("kubelet open:1 rpc:1 ok:a kubelet@1 end:b@1", "a=registering b=waiting c=waiting",
                 ["a", "b", "a"], id="restart-starts-over-once-it-ends"),
    pytest.param("stopped kubelet", "a=registering b=waiting c=waiting", ["a"],
                 id="stop-then-start"),
    # A kubelet that dials inside Register (it opened a with the options call)
    # and replies without a dial still holds a client whose connection is
    # gone: a and b are asked again within a fraction of a second, not after
    # two dial waits, and a does not hold up b's registration meanwhile.
    pytest.param(LIVE_ABC + "close:1@20 close:2@20 ok:a@20 tick@20.19",
                 "a=awaiting-dial b=waiting c=live", ["a", "b", "c", "a"],
                 id="held-client-short-wait"),
    pytest.param(LIVE_ABC + "close:1@20 close:2@20 ok:a@20 tick@20.2",
                 "a=unbound b=registering c=live", ["a", "b", "c", "a", "b"],
                 id="held-client-lets-the-next-go"),
    pytest.param(LIVE_ABC + "close:1@20 ok:a@20 tick@20.2 tick@20.39",
                 "a=unbound b=live c=live", ["a", "b", "c", "a"],
                 id="held-client-backs-off"),
    pytest.param(LIVE_ABC + "close:1@20 ok:a@20 tick@20.2 tick@20.4 open:4@20.4 rpc:4@20.4",
                 "a=registering b=live c=live", ["a", "b", "c", "a", "a"],
                 id="held-client-dropped-then-dialled"),
    # A Register that timed out undialled may still make a stalled kubelet
    # dial: nothing else registers on the shared socket for the late dial
    # wait (10 s), so that dial finds no Register to be taken for.
    pytest.param("kubelet timeout:a@15 tick@24.9", "a=waiting b=waiting c=waiting", ["a"],
                 id="timeout-quiets-the-socket"),
    pytest.param("kubelet timeout:a@15 tick@25", "a=waiting b=registering c=waiting",
                 ["a", "b"], id="timeout-quiet-ends"),
    pytest.param("kubelet open:1 rpc:1 open:2 rpc:2 timeout:a@15 timeout:b@15",
                 "a=waiting b=waiting c=registering", ["a", "b", "c"],
                 id="timeout-after-the-dial-quiets-nothing"),
    pytest.param("kubelet timeout:a@15 kubelet@16", "a=registering b=waiting c=waiting",
                 ["a", "a"], id="a-new-kubelet-ends-the-quiet"),
    # A kubelet that dials after replying still gets the full dial wait.
    pytest.param("kubelet ok:a open:1 watch:1 ok:b open:2 watch:2 ok:c open:3 watch:3 "
                 "close:1@20 ok:a@20 tick@22.9",
                 "a=awaiting-dial b=live c=live", ["a", "b", "c", "a"],
                 id="old-kubelet-full-dial-wait"),
]  # fmt: skip


@pytest.mark.parametrize(("steps", "phases", "started"), SINGLE_SCRIPTS)
def test_single_socket_scripts(steps: str, phases: str, started: list[str]) -> None:
    script = Script(SocketMode.SINGLE).run(steps)
    assert script.phases() == phases
    assert script.started == started
    assert len(script.registrar.awaiting_attribution()) <= 1


PER_RESOURCE_SCRIPTS = [
    pytest.param("kubelet", "a=registering b=registering c=registering", ["a", "b", "c"],
                 id="all-at-once"),
    pytest.param("kubelet open:1,a ok:a", "a=live b=registering c=registering",
                 ["a", "b", "c"], id="listener-binds"),
    pytest.param("kubelet ok:b", "a=registering b=awaiting-dial c=registering",
                 ["a", "b", "c"], id="old-kubelet"),
    pytest.param("kubelet ok:b open:1,b", "a=registering b=live c=registering",
                 ["a", "b", "c"], id="old-kubelet-late-dial"),
    pytest.param("kubelet ok:b tick@3", "a=registering b=unbound c=registering",
                 ["a", "b", "c"], id="dial-timeout"),
    pytest.param("kubelet fail:c@1", "a=registering b=registering c=waiting",
                 ["a", "b", "c"], id="failure-backs-off"),
    pytest.param("kubelet fail:c@1 tick@1.1", "a=registering b=registering c=registering",
                 ["a", "b", "c", "c"], id="failure-retries"),
    pytest.param("kubelet timeout:c@15 tick@15.1", "a=registering b=registering c=registering",
                 ["a", "b", "c", "c"], id="timeout-quiets-no-socket-of-its-own"),
    pytest.param("kubelet open:1,a ok:a close:1@2", "a=registering b=registering c=registering",
                 ["a", "b", "c", "a"], id="close-reregisters-alongside-others"),
]  # fmt: skip


@pytest.mark.parametrize(("steps", "phases", "started"), PER_RESOURCE_SCRIPTS)
def test_per_resource_scripts(steps: str, phases: str, started: list[str]) -> None:
    script = Script(SocketMode.PER_RESOURCE).run(steps)
    assert script.phases() == phases
    assert script.started == started


@pytest.mark.parametrize(
    ("steps", "attributed"),
    [
        ("kubelet open:1 rpc:1 rpc:1", ["a", "a"]),
        ("kubelet open:1 rpc:1 ok:a rpc:1", ["a", "a"]),
        ("kubelet open:1 rpc:1 ok:a open:2 rpc:2", ["a", "b"]),
        ("kubelet ok:a tick@3 open:2 watch:2", ["b"]),  # b is in flight by then
        # A kubelet that opened a's connection with GetDevicePluginOptions
        # opens every registration's connection that way: a connection that
        # opens with anything else while b's Register is in flight is a's
        # reconnecting, and is not b's.
        ("kubelet open:1 rpc:1 open:2 watch:2", ["a", None]),
        ("kubelet open:1 rpc:1 close:1 ok:a open:2 watch:2 open:3 rpc:3", ["a", None, "b"]),
        ("kubelet open:1 rpc:1 ok:a open:2 rpc:2 ok:b open:3 watch:3", ["a", "b", None]),
        ("kubelet open:1 rpc:1 ok:a open:2 alloc:2", ["a", None]),
        # Kubelets that dial after replying (1.24 and earlier) never make that
        # call, and keep the timing rule alone: they open with ListAndWatch,
        # or with an Allocate for devices still listed from before.
        ("kubelet ok:a open:1 watch:1 ok:b open:2 watch:2", ["a", "b"]),
        ("kubelet ok:a open:1 alloc:1 watch:1", ["a", "a"]),
        # What was learned is the old kubelet's: a restarted one is asked again.
        ("kubelet open:1 rpc:1 ok:a kubelet@1 end:b@1 open:2 watch:2@1", ["a", "a"]),
        # A reply that comes before any dial teaches nothing either.
        ("kubelet ok:a open:1 rpc:1 ok:b open:2 watch:2", ["a", "b"]),
        # A 1.25+ kubelet that still holds a client for a replies without
        # dialling: the rule stays, and b's reconnection is not given to a.
        (
            "kubelet open:1 rpc:1 ok:a open:2 rpc:2 ok:b open:3 rpc:3 ok:c "
            "close:1@20 ok:a@20 open:4@20 alloc:4@20",
            ["a", "b", "c", None],
        ),
        # ... nor after a's wait for the dial runs out and a registers again:
        # a refused Allocate does not unlearn the rule, and a connection that
        # opened before a Register started is never that Register's dial.
        (
            "kubelet open:1 rpc:1 ok:a open:2 rpc:2 ok:b open:3 rpc:3 ok:c "
            "close:1@20 ok:a@20 open:4@20 alloc:4@20 tick@23 tick@26.3 alloc:4@26.4 watch:4@26.4",
            ["a", "b", "c", None, None, None],
        ),
        # ... nor by b's reconnection opening with ListAndWatch while a's
        # Register got a reply without a dial (the kubelet still held a's
        # client): that is no dial of a's, refused, so a new connection that
        # opens with ListAndWatch during a's next Register is still refused.
        (
            "kubelet open:1 rpc:1 ok:a open:2 rpc:2 ok:b open:3 rpc:3 ok:c "
            "close:1@20 close:2@20 ok:a@20 open:4@20.1 watch:4@20.1 tick@20.2 "
            "fail:b@20.2 tick@20.5 open:5@20.5 watch:5@20.5",
            ["a", "b", "c", None, None],
        ),
        # The late dial of a Register that timed out finds nothing in flight.
        ("kubelet timeout:a@15 open:9@20 rpc:9@20 tick@25 open:10@25 rpc:10@25", [None, "b"]),
        # A dial of a Register sent before a kubelet restart is not the dial
        # of the Register that follows the restart.
        ("kubelet open:10 kubelet@1 end:a@1 watch:10@1 open:11@1 watch:11@1", [None, "a"]),
        ("kubelet open:1 ok:a watch:1", ["a"]),  # opened during a's Register: a's
        ("kubelet open:7 ok:a open:1 watch:1 watch:7", ["a", None]),  # opened before b's
        # A stray GetDevicePluginOptions (another client's, on a connection of
        # its own) can teach the rule to a kubelet that dials after replying:
        # once a registration has waited in vain while a dial was refused,
        # the rule is unlearned.
        (
            "kubelet open:9 rpc:9 fail:a open:1 watch:1 ok:b open:2 watch:2 "
            "tick@3 open:3@3 watch:3@3",
            ["a", None, None, "c"],
        ),
    ],
)
def test_attribution(steps: str, attributed: list[str | None]) -> None:
    assert Script(SocketMode.SINGLE).run(steps).attributed == attributed


def test_rpc_with_nothing_in_flight_is_unattributed() -> None:
    script = Script(SocketMode.SINGLE, names=("a",)).run("kubelet ok:a tick@3 open:2@4 rpc:2@4")
    assert script.attributed == [None]
    assert script.phases() == "a=unbound"
    assert script.registrar.orphan_seen(4.0) == ["a"]
    assert script.phases() == "a=waiting"
    assert [r.name for r in script.registrar.due(4.0)] == ["a"]


def test_orphan_requeues_only_unbound_resources() -> None:
    script = Script(SocketMode.SINGLE, names=("a", "b")).run(
        "kubelet open:1 rpc:1 ok:a ok:b tick@3"
    )
    assert script.phases() == "a=live b=unbound"
    assert script.registrar.orphan_seen(5.0) == ["b"]


def test_stale_replies_are_ignored() -> None:
    r = Registrar(SocketMode.SINGLE)
    r.track(["a"], 0.0)
    r.kubelet_started(0.0)
    (reg,) = r.due(0.0)
    first = r.start(reg)
    r.kubelet_started(1.0)
    # The first call never saw its connection, so the new kubelet might still
    # dial for it: nothing starts until that call has ended.
    assert r.due(1.0) == []
    assert not r.failed("a", first, 1.2)
    (reg,) = r.due(1.2)
    second = r.start(reg)
    assert second != first
    assert not r.succeeded("a", first, 1.5)
    assert not r.failed("a", first, 1.5)
    assert not r.succeeded("unknown", second, 1.5)
    assert r.phases() == {"a": Phase.REGISTERING}
    assert r.succeeded("a", second, 2.0)
    assert not r.succeeded("a", second, 2.0)  # a second reply for the same attempt


def test_untracked_resource_is_a_usage_error() -> None:
    r = Registrar(SocketMode.SINGLE)
    with pytest.raises(UsageError, match="not tracked"):
        r.get("nope")
    with pytest.raises(UsageError):
        r.opened(1, "nope", 0.0)


@pytest.mark.parametrize(
    ("failures", "delay"),
    [(0, 0.0), (1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (6, 3.2), (7, 5.0), (50, 5.0)],
)
def test_backoff_delays(failures: int, delay: float) -> None:
    assert Backoff(first=0.1, cap=5.0).delay(failures) == pytest.approx(delay)


# ---------------------------------------------------------------------------
# Through StandardNode: inputs -> effects

A, B = VF_RESOURCE, GPU_RESOURCE  # "intel.com/qat_vf" sorts first


def registers(effects: list[object]) -> list[tuple[str, int]]:
    return [(e.resource, e.attempt) for e in effects if isinstance(e, Register)]


def test_node_registers_nothing_until_the_kubelet_is_there() -> None:
    node = StandardNode(gpu_config(shared_devices=()))
    effects = node.handle(HostObserved(two_gpus_and_vfs(), 0.0))
    effects += node.handle(Tick(1.0))
    assert effects_of(effects, Register) == []
    effects = node.handle(KubeletStarted(2.0))
    assert registers(effects) == [(A, 1)]


def test_single_socket_register_options_and_endpoint() -> None:
    node, effects = started_node()
    register = one(effects, Register)
    assert register == Register(A, "dp.sock", PluginOptions(False, True), 1, own_socket=False)
    assert node.next_deadline() is None  # nothing to wait for but the reply


def test_shared_resources_do_not_offer_preferred_allocation() -> None:
    node, effects = started_node(gpu_config())  # default shared devices sort first
    register = one(effects, Register)
    assert register.resource == "devices.kubevirt.io/kvm"
    assert register.options == PluginOptions(False, False)


def test_modern_kubelet_handshake() -> None:
    node, effects = started_node()
    assert registers(effects) == [(A, 1)]
    assert node.handle(ConnectionOpened(1, 0.1)) == []
    effects = node.handle(OptionsRequested(1, 77, 0.1))
    assert effects[:2] == [AttributeConnection(1, A), Reply(77, PluginOptions(False, True))]
    # A's connection is attributed, so B need not wait for A's reply.
    assert registers(effects) == [(B, 2)]
    effects = node.handle(RegistrationSucceeded(A, 1, 0.2))
    assert registers(effects) == []
    assert node.device_plugin.registrar.phases()[A] is Phase.LIVE
    # Later RPCs on the connection are served for A without binding again.
    effects = node.handle(WatchStarted(1, 500, 0.3))
    assert [type(e) for e in effects] == [type(effects[0])]
    assert effects[0].resource == A  # type: ignore[union-attr]
    # And a second connection during Register(B) goes to B.
    node.handle(ConnectionOpened(2, 0.3))
    effects = node.handle(OptionsRequested(2, 78, 0.3))
    assert effects[0] == AttributeConnection(2, B)


def test_old_kubelet_dials_after_the_reply() -> None:
    node, effects = started_node()
    effects = node.handle(RegistrationSucceeded(A, 1, 1.0))
    assert registers(effects) == []
    assert node.next_deadline() == pytest.approx(4.0)  # dial_wait 3 s
    node.handle(ConnectionOpened(1, 1.5))
    effects = node.handle(OptionsRequested(1, 5, 1.5))
    assert effects[:2] == [AttributeConnection(1, A), Reply(5, PluginOptions(False, True))]
    assert registers(effects) == [(B, 2)]


def test_dial_timeout_gives_up_and_registers_the_next() -> None:
    node, _ = started_node()
    node.handle(RegistrationSucceeded(A, 1, 1.0))
    assert registers(node.handle(Tick(3.99))) == []
    effects = node.handle(Tick(4.0))
    assert registers(effects) == [(B, 2)]
    warning = one(effects, Log)
    assert warning.level == "warning" and warning.event == "registration-unattributed"
    assert node.device_plugin.registrar.phases()[A] is Phase.UNBOUND


def test_an_unbound_resource_registers_again_when_no_late_dial_comes() -> None:
    """The kubelet's connection for A closed before its first RPC: no RPC will
    ever come to requeue A, so after waiting once more it registers again, and
    waits longer after each miss."""
    node, _ = started_node()
    node.handle(RegistrationSucceeded(A, 1, 1.0))
    node.handle(ConnectionOpened(1, 1.1))
    node.handle(ConnectionClosed(1, 1.1))
    node.handle(Tick(4.0))  # dial timeout: A unbound, B registering
    node.handle(RegistrationSucceeded(B, 2, 4.1))
    node.handle(ConnectionOpened(2, 4.2))
    node.handle(WatchStarted(2, 1, 4.2))  # B's dial, after its reply
    assert node.device_plugin.registrar.phases() == {A: Phase.UNBOUND, B: Phase.LIVE}
    # Waits dial_wait (3 s) plus the backoff of one miss (20 ms) for a late RPC.
    assert node.next_deadline() == pytest.approx(7.02)
    assert registers(node.handle(Tick(7.0))) == []
    assert registers(node.handle(Tick(7.02))) == [(A, 3)]
    node.handle(RegistrationSucceeded(A, 3, 7.1))
    node.handle(Tick(10.1))  # missed again: the wait grows
    assert node.next_deadline() == pytest.approx(10.1 + 3.0 + 0.04)


def test_rpc_on_unattributed_connection_is_rejected_and_unbound_reregister() -> None:
    node, _ = started_node()
    node.handle(RegistrationSucceeded(A, 1, 1.0))
    node.handle(Tick(4.0))  # A unbound, B registering
    node.handle(ConnectionOpened(1, 4.1))
    node.handle(OptionsRequested(1, 1, 4.1))  # binds to B
    node.handle(RegistrationSucceeded(B, 2, 4.2))
    node.handle(ConnectionOpened(9, 5.0))
    effects = node.handle(OptionsRequested(9, 42, 5.0))
    reject = effects[0]
    assert isinstance(reject, Reject)
    assert reject.call == 42 and reject.status is StatusCode.UNAVAILABLE
    assert "connection 9" in reject.message and A in reject.message
    assert registers(effects) == [(A, 3)]
    assert effects_of(effects, Reply) == []


def test_watch_on_unattributed_connection_is_ended() -> None:
    node, _ = started_node()
    node.handle(RegistrationSucceeded(A, 1, 1.0))
    node.handle(Tick(4.0))
    node.handle(ConnectionOpened(1, 4.1))
    node.handle(OptionsRequested(1, 1, 4.1))
    node.handle(RegistrationSucceeded(B, 2, 4.2))
    node.handle(ConnectionOpened(9, 5.0))
    effects = node.handle(WatchStarted(9, 600, 5.0))
    end = effects[0]
    assert isinstance(end, EndStream) and end.stream == 600
    assert node.device_plugin.streams(A) == [] and node.device_plugin.streams(B) == []


def test_a_reconnection_is_not_taken_for_the_next_registrations_dial() -> None:
    """A's connection closes after its GetDevicePluginOptions and before the
    Register reply; grpc-go then reconnects for A's ListAndWatch while B's
    Register is in flight. Bound to B, that stream would list B's devices as
    A's, and A's Allocates would be answered for B."""
    node, _ = started_node()
    node.handle(ConnectionOpened(1, 0.0))
    node.handle(OptionsRequested(1, 1, 0.0))  # binds A; B's Register starts
    node.handle(ConnectionClosed(1, 0.1))
    node.handle(RegistrationSucceeded(A, 1, 0.2))  # no connection left: A goes again later
    assert node.device_plugin.registrar.in_flight() is not None
    assert node.device_plugin.registrar.in_flight().name == B  # type: ignore[union-attr]
    node.handle(ConnectionOpened(2, 0.3))
    effects = node.handle(WatchStarted(2, 700, 0.3))
    end = effects[0]
    assert isinstance(end, EndStream) and end.stream == 700
    assert "opened with ListAndWatch" in end.reason and B in end.reason
    assert effects_of(effects, AttributeConnection) == [] and effects_of(effects, Publish) == []
    assert node.device_plugin.registrar.owner(2) is None
    # B's own dial still binds to B, and A registers again after it.
    node.handle(ConnectionOpened(3, 0.4))
    effects = node.handle(OptionsRequested(3, 2, 0.4))
    assert effects[0] == AttributeConnection(3, B)
    assert registers(effects) == [(A, 3)]


def test_registration_failure_backs_off() -> None:
    node, _ = started_node(timing=Timing(backoff=Backoff(first=0.1, cap=0.5)))
    node.handle(RegistrationFailed(A, 1, "kubelet said no", 10.0))
    # B goes first while A waits.
    node.handle(RegistrationSucceeded(B, 2, 10.0))
    node.handle(ConnectionOpened(1, 10.0))
    node.handle(OptionsRequested(1, 1, 10.0))  # B was awaiting dial: now live
    attempt = 2
    now = 10.0
    for expected_delay in (0.1, 0.2, 0.4, 0.5, 0.5):
        deadline = node.next_deadline()
        assert deadline == pytest.approx(now + expected_delay)
        assert registers(node.handle(Tick(deadline - 0.01))) == []
        effects = node.handle(Tick(deadline))
        attempt += 1
        assert registers(effects) == [(A, attempt)]
        now = deadline
        effects = node.handle(RegistrationFailed(A, attempt, "still no", now))
        log = one(effects, Log)
        assert log.event == "registration-failed"
        assert ("reason", "still no") in log.fields


def test_by_default_a_refused_register_is_tried_again_after_20_ms() -> None:
    node, _ = started_node()  # default timing
    effects = node.handle(RegistrationFailed(A, 1, "ConnectionRefusedError", 10.0))
    assert ("retry_in", 0.02) in one(effects, Log).fields
    node.handle(RegistrationFailed(B, 2, "ConnectionRefusedError", 10.0))
    assert node.next_deadline() == pytest.approx(10.02)
    assert registers(node.handle(Tick(10.019))) == []
    assert registers(node.handle(Tick(10.02))) == [(A, 3)]


def test_a_stale_unbound_attempt_holds_the_socket_until_it_ends() -> None:
    node, _ = started_node()
    # Attempt 1 might still make the new kubelet dial: A waits for it to end.
    assert registers(node.handle(KubeletStarted(1.0))) == []
    effects = node.handle(RegistrationFailed(A, 1, "old", 1.1))
    assert registers(effects) == [(A, 2)]
    assert not any(isinstance(e, Log) and e.event == "registration-failed" for e in effects)
    assert node.handle(RegistrationSucceeded(A, 1, 1.1)) == []
    assert node.device_plugin.registrar.phases()[A] is Phase.REGISTERING


def make_live(node: StandardNode, resource: str, attempt: int, connection: int, now: float) -> None:
    node.handle(ConnectionOpened(connection, now))
    node.handle(OptionsRequested(connection, connection, now))
    node.handle(RegistrationSucceeded(resource, attempt, now))
    assert node.device_plugin.registrar.phases()[resource] is Phase.LIVE


def test_losing_the_last_connection_reregisters_with_backoff_when_flapping() -> None:
    node, _ = started_node(timing=Timing(backoff=Backoff(first=0.1, cap=5.0, healthy_after=10.0)))
    make_live(node, A, 1, connection=1, now=0.0)
    make_live(node, B, 2, connection=2, now=0.0)
    # A's connection drops: A registers again at once.
    effects = node.handle(ConnectionClosed(1, 1.0))
    assert registers(effects) == [(A, 3)]
    assert one(effects, Log).event == "connection-lost"
    make_live(node, A, 3, connection=3, now=1.0)
    # It keeps dropping soon after each registration: A waits 0.1 s, then 0.2 s.
    effects = node.handle(ConnectionClosed(3, 2.0))
    assert registers(effects) == []
    assert node.next_deadline() == pytest.approx(2.1)
    assert registers(node.handle(Tick(2.09))) == []
    assert registers(node.handle(Tick(2.1))) == [(A, 4)]
    make_live(node, A, 4, connection=4, now=2.1)
    node.handle(ConnectionClosed(4, 3.0))
    assert node.next_deadline() == pytest.approx(3.2)
    assert registers(node.handle(Tick(3.2))) == [(A, 5)]
    make_live(node, A, 5, connection=5, now=3.2)
    # A connection that lived `healthy_after` resets the backoff: at once again.
    effects = node.handle(ConnectionClosed(5, 13.2))
    assert registers(effects) == [(A, 6)]


def test_a_second_connection_keeps_the_resource_live() -> None:
    node, effects = started_node(mode=SocketMode.PER_RESOURCE)
    attempt = {r.resource: r.attempt for r in effects_of(effects, Register)}[A]
    node.handle(ConnectionOpened(1, 0.0, A))
    node.handle(ConnectionOpened(2, 0.0, A))
    node.handle(RegistrationSucceeded(A, attempt, 0.0))
    assert registers(node.handle(ConnectionClosed(1, 1.0))) == []
    assert node.device_plugin.registrar.phases()[A] is Phase.LIVE
    effects = node.handle(ConnectionClosed(2, 1.0))
    assert [name for name, _ in registers(effects)] == [A]  # the last one: at once
    assert one(effects, Log).event == "connection-lost"


def test_closing_an_unknown_connection_does_nothing() -> None:
    node, _ = started_node()
    assert node.handle(ConnectionClosed(12345, 1.0)) == []


def test_register_ends_the_resources_old_streams_first() -> None:
    node, _ = started_node()
    make_live(node, A, 1, connection=1, now=0.0)
    node.handle(WatchStarted(1, 100, 0.0))
    node.handle(WatchStarted(1, 101, 0.0))
    assert sorted(node.device_plugin.streams(A)) == [100, 101]
    # B's call was in flight and unbound: A waits for it to end (the kubelet's
    # start only asks who holds devices).
    effects = without_logs(node.handle(KubeletStarted(1.0)))
    assert [type(e) for e in effects] == [RefreshAllocations]
    effects = without_logs(node.handle(RegistrationFailed(B, 2, "kubelet restarted", 1.1)))
    assert [type(e) for e in effects] == [EndStream, EndStream, Register]
    assert {e.stream for e in effects_of(effects, EndStream)} == {100, 101}
    assert node.device_plugin.streams(A) == []


def test_kubelet_restart_resets_everything() -> None:
    node, _ = started_node(timing=Timing(backoff=Backoff(first=1.0, cap=60.0)))
    make_live(node, A, 1, connection=1, now=0.0)
    node.handle(RegistrationFailed(B, 2, "no", 0.0))
    node.handle(Tick(1.0))
    node.handle(RegistrationFailed(B, 3, "no", 1.0))  # B now backs off 2 s
    effects = node.handle(KubeletStarted(1.5))
    assert registers(effects) == [(A, 4)]
    node.handle(AllocationsObserved({}, 1.5))  # its checkpoint names nothing: synced
    # Old connections are forgotten, and are not the dial of a Register that
    # started after them; a new connection's RPC binds to what is in flight.
    effects = node.handle(OptionsRequested(1, 8, 1.6))
    assert isinstance(effects[0], Reject) and "was open before" in effects[0].message
    node.handle(ConnectionOpened(2, 1.6))
    effects = node.handle(OptionsRequested(2, 9, 1.6))
    assert effects[0] == AttributeConnection(2, A)
    # B's backoff (until 3.0) is gone: it goes as soon as A's connection is bound.
    assert registers(effects) == [(B, 5)]
    # Replies to attempts before the restart are ignored.
    assert node.handle(RegistrationSucceeded(A, 1, 1.7)) == []
    assert node.handle(RegistrationFailed(B, 3, "late", 1.7)) == []
    assert registers(node.handle(RegistrationSucceeded(A, 4, 1.8))) == []
    assert node.device_plugin.registrar.phases()[A] is Phase.LIVE


def test_kubelet_stopped_holds_registration_until_started() -> None:
    node, _ = started_node()
    node.handle(KubeletStopped(0.5))
    node.handle(RegistrationFailed(A, 1, "connection refused", 1.0))
    assert node.next_deadline() is None
    for now in (2.0, 10.0, 100.0):
        assert registers(node.handle(Tick(now))) == []
    assert registers(node.handle(KubeletStarted(101.0))) == [(A, 2)]


def settled(effects: list[object]) -> int:
    return len([e for e in effects if isinstance(e, RegistrationsSettled)])


def test_the_shell_is_told_once_each_time_every_registration_has_settled() -> None:
    """`RegistrationsSettled` comes with the input that makes the last
    resource live again, after a kubelet start, a lost connection or a
    failed Register, and with no other input: the shell collects what a
    storm of Registers left, once it is over."""
    node = StandardNode(gpu_config(shared_devices=()), timing=Timing(backoff=Backoff(first=1.0)))
    table: list[tuple[object, int]] = [
        (HostObserved(two_gpus_and_vfs(), 0.0), 0),  # A and B wait for a kubelet
        (KubeletStarted(0.0), 0),  # A registers
        (AllocationsObserved({}, 0.0), 0),
        (ConnectionOpened(1, 0.1), 0),
        (OptionsRequested(1, 1, 0.1), 0),  # A's dial: B registers
        (RegistrationSucceeded(A, 1, 0.2), 0),  # A live, B not yet
        (ConnectionOpened(2, 0.3), 0),
        (OptionsRequested(2, 2, 0.3), 0),
        (RegistrationSucceeded(B, 2, 0.4), 1),  # both live
        (WatchStarted(2, 100, 0.5), 0),
        (Tick(5.0), 0),
        (ConnectionClosed(1, 6.0), 0),  # A lost: it registers again
        (RegistrationFailed(A, 3, "refused", 6.1), 0),  # and backs off 2 s
        (Tick(7.1), 0),
        (Tick(8.1), 0),  # A registers again
        (ConnectionOpened(3, 8.2), 0),
        (OptionsRequested(3, 3, 8.2), 0),
        (RegistrationSucceeded(A, 4, 8.3), 1),  # both live again
        (Tick(9.0), 0),
        (KubeletStarted(10.0), 0),  # a kubelet restart: everything registers again
        (ConnectionOpened(4, 10.1), 0),
        (OptionsRequested(4, 4, 10.1), 0),
        (RegistrationSucceeded(A, 5, 10.2), 0),
        (ConnectionOpened(5, 10.3), 0),
        (OptionsRequested(5, 5, 10.3), 0),
        (RegistrationSucceeded(B, 6, 10.4), 1),
        (AllocationsObserved({}, 11.0), 0),
    ]
    for event, expected in table:
        assert settled(node.handle(event)) == expected, event  # type: ignore[arg-type]
    assert set(node.device_plugin.registrar.phases().values()) == {Phase.LIVE}


def test_a_node_with_nothing_to_register_never_says_it_settled() -> None:
    node = StandardNode(Config(shared_devices=()))
    effects = node.handle(HostObserved(HostSnapshot(), 0.0))
    effects += node.handle(KubeletStarted(0.1))
    effects += node.handle(Tick(5.0))
    assert node.device_plugin.resource_names() == ()
    assert settled(effects) == 0


def test_monitoring_reads_a_view_taken_at_one_moment() -> None:
    node, _ = started_node()  # A registering, B waiting its turn
    before = node.device_plugin.view()
    assert before.phases == ((A, Phase.REGISTERING), (B, Phase.WAITING))
    assert before.resources == (A, B)
    assert before.cdi_problem == ""  # no CDI
    make_live(node, A, 1, connection=1, now=0.1)
    make_live(node, B, 2, connection=2, now=0.2)
    assert node.device_plugin.view().phases == ((A, Phase.LIVE), (B, Phase.LIVE))
    # A value: what was taken before does not follow the front end.
    assert before.phases == ((A, Phase.REGISTERING), (B, Phase.WAITING))
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        before.phases = ()  # type: ignore[misc]
    with pytest.raises(ValueError, match="two phases"):
        attrs.evolve(before, phases=((A, Phase.LIVE), (A, Phase.WAITING)))


def test_per_resource_mode_registers_everything_at_once() -> None:
    node, effects = started_node(mode=SocketMode.PER_RESOURCE)
    found = effects_of(effects, Register)
    assert [(r.resource, r.attempt) for r in found] == [(A, 1), (B, 2)]
    assert all(r.own_socket for r in found)
    assert [r.endpoint for r in found] == [endpoint_name("dp", A), endpoint_name("dp", B)]
    assert found[0].endpoint == "dp-intel.com_qat_vf.sock"
    assert found[1].endpoint == "dp-nvidia.com_T4.sock"


def test_per_resource_connection_binds_on_accept() -> None:
    node, _ = started_node(mode=SocketMode.PER_RESOURCE)
    assert node.handle(ConnectionOpened(7, 0.1, listener=B)) == [AttributeConnection(7, B)]
    assert node.handle(OptionsRequested(7, 1, 0.1)) == [Reply(1, PluginOptions(False, True))]
    node.handle(RegistrationSucceeded(B, 2, 0.2))
    assert node.device_plugin.registrar.phases() == {A: Phase.REGISTERING, B: Phase.LIVE}


def registered_through_options() -> StandardNode:
    """A and B registered on connections 1 and 2, each opened with the options
    call inside its Register: a kubelet from 1.25 on."""
    node, _ = started_node()
    node.handle(ConnectionOpened(1, 0.1))
    node.handle(OptionsRequested(1, 1, 0.1))
    node.handle(RegistrationSucceeded(A, 1, 0.2))
    node.handle(ConnectionOpened(2, 0.3))
    node.handle(OptionsRequested(2, 2, 0.3))
    node.handle(RegistrationSucceeded(B, 2, 0.4))
    return node


def test_a_kubelet_holding_a_client_is_asked_again_once_it_has_dropped_it() -> None:
    """Kubelets from 1.26 answer a Register for a name whose client they still
    hold without dialling ("already connected"). When that client's
    connection has closed, the kubelet drops it within milliseconds; A
    registers again 0.2 s later (plus backoff) and is served."""
    node = registered_through_options()
    assert registers(node.handle(ConnectionClosed(1, 20.0))) == [(A, 3)]
    assert registers(node.handle(RegistrationSucceeded(A, 3, 20.01))) == []
    assert node.next_deadline() == pytest.approx(20.21)
    effects = node.handle(Tick(20.21))
    assert one(effects, Log).event == "registration-unattributed"
    # The kubelet dials inside Register, so no late dial is waited for: only
    # the backoff of the second failure in a row.
    assert node.next_deadline() == pytest.approx(20.21 + 0.04)
    assert registers(node.handle(Tick(20.25))) == [(A, 4)]
    node.handle(ConnectionOpened(3, 20.26))
    effects = node.handle(OptionsRequested(3, 3, 20.26))
    assert effects[0] == AttributeConnection(3, A)
    node.handle(RegistrationSucceeded(A, 4, 20.27))
    assert node.device_plugin.registrar.phases() == {A: Phase.LIVE, B: Phase.LIVE}


def test_a_third_reply_without_a_dial_in_a_row_waits_the_full_dial_wait() -> None:
    """A kubelet that dials after replying, taught the options rule by another
    client's call, would look like one holding a client forever: after two
    short waits the full one comes back, in which its refused dial unlearns
    the rule."""
    node = registered_through_options()
    ((resource, attempt),) = registers(node.handle(ConnectionClosed(1, 20.0)))
    now = 20.0
    for wait in (0.2, 0.2, 3.0):
        node.handle(RegistrationSucceeded(resource, attempt, now))
        deadline = node.next_deadline()
        assert deadline == pytest.approx(now + wait)
        assert deadline is not None
        node.handle(Tick(deadline))
        now = node.next_deadline() or 0.0
        if wait == 3.0:
            break
        ((resource, attempt),) = registers(node.handle(Tick(now)))
    assert node.device_plugin.registrar.phases()[A] is Phase.UNBOUND


# a's connection is lost twice, long apart; each time the kubelet still holds
# a's client at the first Register, drops it, and dials at the next.
TWO_HELD_INCIDENTS = (
    "close:1@20 ok:a@20 tick@20.2 tick@20.5 open:4@20.5 rpc:4@20.5 ok:a@20.5 "
    "close:4@40 ok:a@40 tick@40.2 tick@40.5 open:5@40.5 rpc:5@40.5 ok:a@40.5 "
)


def test_replies_without_a_dial_are_counted_in_a_row() -> None:
    """Each incident has one held reply, then a dialled registration: the
    third incident, 20 s later, gets the short wait again."""
    script = Script(SocketMode.SINGLE).run(
        LIVE_ABC + TWO_HELD_INCIDENTS + "close:5@60 ok:a@60 tick@60.2"
    )
    assert script.registrar.get("a").held_replies == 1
    assert script.phases() == "a=unbound b=live c=live"


def test_per_resource_replies_without_a_dial_are_counted_in_a_row() -> None:
    script = Script(SocketMode.PER_RESOURCE).run(
        "kubelet open:1,a rpc:1 ok:a "
        "close:1@20 ok:a@20 tick@20.2 tick@20.5 open:4,a@20.5 rpc:4@20.5 ok:a@20.5 "
        "close:4@40 ok:a@40 tick@40.2 tick@40.5 open:5,a@40.5 rpc:5@40.5 ok:a@40.5 "
        "close:5@60 ok:a@60 tick@60.2"
    )
    assert script.phases().startswith("a=unbound")


def test_a_later_held_reply_does_not_unlearn_the_options_rule() -> None:
    """Were the third incident's wait the full one, b's refused ListAndWatch
    reconnection would unlearn the rule, and c's Allocate reconnection would
    then be bound to b."""
    script = Script(SocketMode.SINGLE).run(
        LIVE_ABC
        + TWO_HELD_INCIDENTS
        + "close:5@60 close:2@60 ok:a@60 open:6@60.1 watch:6@60.1 tick@60.2 tick@63 "
        "close:3@63 open:7@63 alloc:7@63"
    )
    # rpc:1..5 bound to their resources; b's (6) and c's (7) reconnections refused.
    assert script.attributed == ["a", "b", "c", "a", "a", None, None]


def test_a_stale_register_that_timed_out_also_quiets_the_shared_socket() -> None:
    """A Register sent as the kubelet restarted may reach the new kubelet
    (which is why `kubelet_started` waits such calls out). If it then times
    out, a new kubelet slow to handle it dials late just the same: no Register
    starts for the late dial wait, or that dial is taken for the next one's."""
    script = Script(SocketMode.SINGLE).run("kubelet open:1 rpc:1 kubelet@1")
    assert script.started == ["a", "b"]  # b's Register is stale: nothing starts
    r = script.registrar
    assert not r.failed("b", r.get("b").attempt, 16.0, unanswered=True)  # it timed out
    script.start_due(16.0)
    script.run("open:9@18 rpc:9@18")  # the new kubelet's late dial for b
    assert script.attributed == ["a", None]
    assert script.started == ["a", "b"]


def test_per_resource_mode_learns_that_the_kubelet_dials_inside_register() -> None:
    node, _ = started_node(mode=SocketMode.PER_RESOURCE)
    node.handle(ConnectionOpened(7, 0.1, listener=B))
    assert not node.device_plugin.registrar.opens_with_options
    node.handle(OptionsRequested(7, 1, 0.1))
    assert node.device_plugin.registrar.opens_with_options
    node.handle(RegistrationSucceeded(B, 2, 0.2))
    node.handle(ConnectionOpened(8, 0.2, listener=A))
    node.handle(OptionsRequested(8, 2, 0.2))
    node.handle(RegistrationSucceeded(A, 1, 0.3))
    # B's connection closes; the reply to its next Register comes without a
    # dial: the kubelet still holds B's client, and B is asked again shortly.
    assert registers(node.handle(ConnectionClosed(7, 20.0))) == [(B, 3)]
    node.handle(RegistrationSucceeded(B, 3, 20.1))
    assert node.next_deadline() == pytest.approx(20.3)


def test_per_resource_mode_waits_the_full_dial_wait_for_an_old_kubelet() -> None:
    node, _ = started_node(mode=SocketMode.PER_RESOURCE)
    node.handle(RegistrationSucceeded(A, 1, 0.3))
    assert node.next_deadline() == pytest.approx(3.3)
    node.handle(ConnectionOpened(7, 0.4, listener=A))
    node.handle(WatchStarted(7, 1, 0.4))
    assert not node.device_plugin.registrar.opens_with_options


def test_a_register_that_timed_out_holds_the_shared_socket_for_the_late_dial_wait() -> None:
    node, _ = started_node()
    effects = node.handle(RegistrationFailed(A, 1, "timed out", 15.0, unanswered=True))
    log = one(effects, Log)
    assert log.event == "registration-failed" and ("retry_in", 10.0) in log.fields
    assert node.next_deadline() == pytest.approx(25.0)
    assert registers(node.handle(Tick(24.99))) == []
    assert registers(node.handle(Tick(25.0))) == [(B, 2)]


def test_per_resource_connection_for_unknown_listener_is_a_usage_error() -> None:
    node, _ = started_node(mode=SocketMode.PER_RESOURCE)
    with pytest.raises(UsageError, match="unknown resource"):
        node.handle(ConnectionOpened(7, 0.1, listener="example.com/nothing"))


@pytest.mark.parametrize(
    ("prefix", "resource", "expected"),
    [
        ("dp", None, "dp.sock"),
        ("dp", "nvidia.com/T4", "dp-nvidia.com_T4.sock"),
        ("kv", "devices.kubevirt.io/vhost-net", "kv-devices.kubevirt.io_vhost-net.sock"),
        ("dp", "a.io/x y:z", "dp-a.io_x_y_z.sock"),
    ],
)  # fmt: skip
def test_endpoint_name(prefix: str, resource: str | None, expected: str) -> None:
    assert endpoint_name(prefix, resource) == expected


LONG = "example.com/" + "x" * 60


@pytest.mark.parametrize(
    ("resource", "max_length", "expected"),
    [
        ("nvidia.com/T4", 21, "dp-nvidia.com_T4.sock"),  # fits exactly: unchanged
        ("nvidia.com/T4", 20, "dp-nvi-{digest}.sock"),
        (LONG, 40, "dp-example.com_xxxxxxxxxxx-{digest}.sock"),
        (LONG, 16, "dp-{digest}.sock"),  # the least that works: the digest alone
    ],
)  # fmt: skip
def test_endpoint_name_is_cut_to_fit_with_a_digest(
    resource: str, max_length: int, expected: str
) -> None:
    import zlib

    digest = f"{zlib.crc32(resource.encode()):08x}"
    name = endpoint_name("dp", resource, max_length)
    assert name == expected.format(digest=digest)
    assert len(name) <= max_length
    assert min_endpoint_length("dp") == 16


def test_cut_endpoint_names_stay_distinct() -> None:
    names = {endpoint_name("dp", f"example.com/{'y' * 50}-{i}", 30) for i in range(500)}
    assert len(names) == 500 and all(len(n) <= 30 for n in names)


def test_a_name_limit_shorter_than_any_name_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="at least 16"):
        endpoint_name("dp", "nvidia.com/T4", 15)
    with pytest.raises(UsageError, match="at least 16"):
        StandardNode(Config(), endpoint_max_length=15)


def test_new_resource_registers_when_it_appears() -> None:
    node, _ = started_node()
    make_live(node, A, 1, connection=1, now=0.0)
    make_live(node, B, 2, connection=2, now=0.0)
    kvm = SharedDevice("devices.kubevirt.io/kvm", "/dev/kvm", 2)
    config = attrs.evolve(gpu_config(), shared_devices=(kvm,))
    effects = node.handle(ConfigApplied(config, 1.0))
    assert registers(effects) == [("devices.kubevirt.io/kvm", 3)]
    discovered = [e for e in effects_of(effects, Log) if e.event == "resource-discovered"]
    assert [dict(e.fields)["resource"] for e in discovered] == ["devices.kubevirt.io/kvm"]


@pytest.mark.parametrize("mode", [SocketMode.SINGLE, SocketMode.PER_RESOURCE])
def test_connection_lost_while_register_in_flight_registers_again(mode: SocketMode) -> None:
    """The kubelet dialled inside Register, then the connection closed before the reply.

    The resource must not count as live with no connection: the kubelet never
    redials, so only a new Register brings it back.
    """
    node, effects = started_node(mode=mode)
    register = effects_of(effects, Register)[0]
    listener = register.resource if mode is SocketMode.PER_RESOURCE else None
    node.handle(ConnectionOpened(1, 0.0, listener))
    node.handle(OptionsRequested(1, 1, 0.0))
    assert node.handle(ConnectionClosed(1, 0.1)) == []
    effects = node.handle(RegistrationSucceeded(register.resource, register.attempt, 0.2))
    phase = node.device_plugin.registrar.phases()[register.resource]
    if mode is SocketMode.PER_RESOURCE:
        assert phase is Phase.REGISTERING
        assert registers(effects) == [(register.resource, 3)]
    else:
        # Single socket: B started once A's connection was attributed; A goes
        # again after B's own connection is.
        assert phase is Phase.WAITING
        assert registers(effects) == []
        make_live(node, B, 2, connection=2, now=0.3)
        assert node.device_plugin.registrar.phases()[A] is Phase.REGISTERING


def test_a_stray_options_call_does_not_lock_out_a_kubelet_that_dials_after_replying() -> None:
    """Another client's GetDevicePluginOptions while a Register is in flight
    teaches the rule for kubelets that open with it. A kubelet that dials
    after replying (1.24 and earlier) opens with ListAndWatch: its first dial
    is refused, and once that registration has waited in vain the rule is
    unlearned and every resource ends up served."""
    node, effects = started_node()
    (first,) = effects_of(effects, Register)
    queue = list(node.handle(ConnectionOpened(1, 0.0)))
    queue += node.handle(OptionsRequested(1, 2, 0.0))  # the stray client
    queue += node.handle(ConnectionClosed(1, 0.1))
    assert node.device_plugin.registrar.opens_with_options
    queue += node.handle(RegistrationSucceeded(first.resource, first.attempt, 0.1))
    now, refused, connection = 0.1, 0, 1000
    for _ in range(40):
        now += 0.5
        queue += node.handle(Tick(now))
        registers = effects_of(queue, Register)
        queue = []
        for register in registers[:1]:  # the old kubelet: reply, then dial
            connection += 1
            queue += node.handle(RegistrationSucceeded(register.resource, register.attempt, now))
            queue += node.handle(ConnectionOpened(connection, now))
            watch = node.handle(WatchStarted(connection, 5000 + connection, now))
            if effects_of(watch, EndStream):
                refused += 1
                watch += node.handle(ConnectionClosed(connection, now))
            queue += watch
    assert refused == 1
    assert set(node.device_plugin.registrar.phases().values()) == {Phase.LIVE}
    assert not node.device_plugin.registrar.opens_with_options


def test_a_kubelet_that_replies_without_dialling_keeps_the_options_rule() -> None:
    """Some 1.25+ kubelets answer a Register at once, without dialling, while
    they still hold a client for the resource. The Allocate of another
    resource's reconnection, refused meanwhile, is no sign of a kubelet that
    dials after replying: the rule stays once a's wait runs out."""
    script = Script(SocketMode.SINGLE).run(
        "kubelet open:1 rpc:1 ok:a open:2 rpc:2 ok:b open:3 rpc:3 ok:c "
        "close:1@20 ok:a@20 open:4@20 alloc:4@20 tick@23"
    )
    assert script.attributed[-1] is None
    assert script.phases() == "a=unbound b=live c=live"
    assert script.registrar.opens_with_options
