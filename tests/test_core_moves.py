"""A resource moving between front ends on a live node: its phases, and one server at a time.

The host of test_core_dra: GPU and audio function in IOMMU groups 10 and 20;
the audio functions move between the device plugin and DRA while a VM holds
group 20 through the side they leave.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_core_dra import CLAIM_A, config, prepare, started, unprepare

from dp_core import AllocationsObserved, ConfigApplied, Node
from dp_core.deviceplugin.effects import Publish
from dp_core.dra.effects import ClaimPrepared, PoolChanged
from dp_core.effects import Log

from core_builders import Kubelet, effects_of

AUDIO = "nvidia.com/audio"
AUDIO_DEVICES = {"pci-0000-3b-00-1", "pci-0000-af-00-1"}
LET_GO = "nothing of the old side holds its devices"


def moves(effects: list[object]) -> list[tuple[str, dict[str, object]]]:
    return [
        (log.event, dict(log.fields))
        for log in effects_of(effects, Log)
        if log.event.startswith("frontend-move")
    ]


def listed(effects: list[object], resource: str) -> list[tuple[str, bool]] | None:
    """What the device plugin last sent for `resource` in `effects` (None: nothing)."""
    sent = [p for p in effects_of(effects, Publish) if p.resource == resource]
    return [(d.id, d.healthy) for d in sent[-1].devices] if sent else None


def offered(node: Node) -> set[str]:
    pool = node.dra.pool
    return {d.name for d in pool.devices} if pool is not None else set()


def test_a_move_to_dra_starts_with_the_held_group_and_finishes_when_it_is_let_go() -> None:
    node, effects = started(dra_device_taints=True)
    Kubelet(node).register_all(effects)  # type: ignore[arg-type]
    assert not AUDIO_DEVICES & offered(node)
    # A VM holds the audio function of group 20 through the device plugin.
    node.handle(AllocationsObserved({AUDIO: frozenset({"0000:af:00.1"})}, 1.0))

    effects = node.handle(ConfigApplied(config(audio_frontend="dra"), 2.0))
    assert moves(effects) == [
        (
            "frontend-move-started",
            {
                "resource": AUDIO,
                "from": "device-plugin",
                "to": "dra",
                "held_groups": "20",
                "holders": "allocation #1 of nvidia.com/audio (0000:af:00.1)",
            },
        )
    ]
    # One server at a time: the device plugin lists nothing (the kubelet keeps
    # the name, at 0 allocatable) while the pool offers both functions.
    assert listed(effects, AUDIO) == []
    assert AUDIO_DEVICES <= offered(node)
    pool = effects_of(effects, PoolChanged)[-1].content
    held = pool.device("pci-0000-af-00-1")
    assert held is not None and held.taints, "the held function is marked for the scheduler"

    # Still held: nothing finishes.
    assert moves(node.handle(AllocationsObserved({AUDIO: frozenset({"0000:af:00.1"})}, 3.0))) == []
    finished = []
    for now in (10.0, 60.0, 120.0):
        finished += moves(node.handle(AllocationsObserved({}, now)))
    assert finished == [
        (
            "frontend-move-finished",
            {"resource": AUDIO, "from": "device-plugin", "to": "dra", "why": LET_GO},
        )
    ]
    assert node.moves.moving == ()


def test_a_move_back_keeps_the_claims_groups_until_they_are_unprepared() -> None:
    node, effects = started(config(audio_frontend="dra"), dra_device_taints=True)
    kubelet = Kubelet(node)
    kubelet.register_all(effects)  # type: ignore[arg-type]
    prepare(node, CLAIM_A, "pci-0000-af-00-1")

    effects = node.handle(ConfigApplied(config(audio_frontend="device-plugin"), 2.0))
    kubelet.now = 2.0
    effects += kubelet.register_all(effects)  # type: ignore[arg-type]
    (started_move,) = moves(effects)
    assert started_move == (
        "frontend-move-started",
        {
            "resource": AUDIO,
            "from": "dra",
            "to": "device-plugin",
            "held_groups": "20",
            "holders": "claim vms/vm-a (UID uid-a)",
        },
    )
    # The device plugin offers the held function as unhealthy; DRA offers neither.
    assert sorted(listed(effects, AUDIO) or []) == [("0000:3b:00.1", True), ("0000:af:00.1", False)]
    assert not AUDIO_DEVICES & offered(node)

    effects = unprepare(node, CLAIM_A, now=3.0)
    assert moves(effects) == [
        (
            "frontend-move-finished",
            {"resource": AUDIO, "from": "dra", "to": "device-plugin", "why": LET_GO},
        )
    ]
    assert ("0000:af:00.1", True) in (listed(effects, AUDIO) or [])


def test_a_move_with_nothing_held_finishes_as_it_starts_and_no_change_logs_nothing() -> None:
    node, _ = started()
    effects = node.handle(ConfigApplied(config(audio_frontend="dra"), 1.0))
    assert [event for event, _ in moves(effects)] == [
        "frontend-move-started",
        "frontend-move-finished",
    ]
    assert moves(effects)[0][1]["held_groups"] == ""
    assert moves(node.handle(ConfigApplied(config(audio_frontend="dra"), 2.0))) == []
    assert moves(node.handle(AllocationsObserved({}, 3.0))) == []


def test_a_move_back_before_the_holders_let_go_ends_the_first_move() -> None:
    node, _ = started()
    node.handle(AllocationsObserved({AUDIO: frozenset({"0000:af:00.1"})}, 1.0))
    node.handle(ConfigApplied(config(audio_frontend="dra"), 2.0))
    effects = node.handle(ConfigApplied(config(audio_frontend="device-plugin"), 3.0))
    assert [(event, f["from"], f.get("why")) for event, f in moves(effects)] == [
        ("frontend-move-finished", "device-plugin", "moved back before its holders let go"),
        ("frontend-move-started", "dra", None),
        ("frontend-move-finished", "dra", LET_GO),
    ]


def test_a_group_held_by_the_new_side_does_not_hold_up_the_move() -> None:
    """A claim on the GPU of group 20 holds the group through DRA: moving the
    audio function to DRA waits for no one."""
    node, _ = started()
    prepare(node, CLAIM_A, "pci-0000-af-00-0")
    effects = node.handle(ConfigApplied(config(audio_frontend="dra"), 2.0))
    assert [event for event, _ in moves(effects)] == [
        "frontend-move-started",
        "frontend-move-finished",
    ]


@given(st.lists(st.sampled_from(["flip", "hold", "release", "prepare", "unprepare"]), max_size=14))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_name_is_never_served_twice_and_every_move_finishes_once_nothing_holds(
    steps: list[str],
) -> None:
    """Random moves of the audio functions back and forth, a VM holding
    0000:af:00.1 through the device plugin, a claim holding it through DRA."""
    node, effects = started(dra_device_taints=True)
    kubelet = Kubelet(node)
    effects += kubelet.register_all(effects)  # type: ignore[arg-type]
    published = {
        p.resource: [(d.id, d.healthy) for d in p.devices] for p in effects_of(effects, Publish)
    }
    logged: list[str] = []
    frontend, now, dp_held, claimed, call = "device-plugin", 1.0, False, False, 10

    def seen(out: list[object]) -> None:
        kubelet.now = now
        out += kubelet.register_all(out)  # type: ignore[arg-type]
        for publish in effects_of(out, Publish):
            published[publish.resource] = [(d.id, d.healthy) for d in publish.devices]
        logged.extend(event for event, _ in moves(out))

    for step in steps:
        now += 40.0  # past the release grace: a pod gone is let go at the next answer
        call += 2
        if step == "flip":
            frontend = "dra" if frontend == "device-plugin" else "device-plugin"
            seen(node.handle(ConfigApplied(config(audio_frontend=frontend), now)))
        elif step == "hold" and frontend == "device-plugin" and not claimed:
            dp_held = True
        elif step == "release":
            dp_held = False
        elif step == "prepare" and frontend == "dra" and not dp_held and not claimed:
            out = prepare(node, CLAIM_A, "pci-0000-af-00-1", call=call, now=now)
            claimed = bool(effects_of(out, ClaimPrepared))
            seen(out)
        elif step == "unprepare" and claimed:
            seen(unprepare(node, CLAIM_A, call=call, now=now))
            claimed = False
        held = {AUDIO: frozenset({"0000:af:00.1"})} if dp_held else {}
        seen(node.handle(AllocationsObserved(held, now)))

        # One front end serves the name: the other lists nothing of it.
        if frontend == "dra":
            assert published.get(AUDIO, []) == []
            assert AUDIO_DEVICES <= offered(node)
        else:
            assert {d for d, _ in published[AUDIO]} == {"0000:3b:00.1", "0000:af:00.1"}
            assert not AUDIO_DEVICES & offered(node)
        # Phases pair up: a move is under way exactly while its old side holds group 20.
        assert logged.count("frontend-move-started") - logged.count(
            "frontend-move-finished"
        ) == len(node.moves.moving)
        for move in node.moves.moving:
            old_side_holds = dp_held if move.source == "device-plugin" else claimed
            assert old_side_holds
