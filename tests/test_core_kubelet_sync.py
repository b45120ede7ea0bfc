"""A kubelet that has just started: what dp holds back until PodResources can be trusted.

Tables of inputs and the effects they give, and a property over random orders
of kubelet starts, dp starts, young and synced answers and checkpoint writes
against a model of the kubelet's device manager (`deviceplugin.sync`'s docstring
names the kubelet sources it follows). No event loop.
"""

from __future__ import annotations

import itertools

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dp_core import (
    AllocationsObserved,
    CheckpointEntry,
    Effect,
    HealthChanged,
    HostObserved,
    KubeletCheckpoint,
    KubeletCheckpointObserved,
    KubeletCheckpointWanted,
    KubeletStarted,
    Log,
    Publish,
    RefreshAllocations,
    Reject,
    Reply,
    StandardNode,
    StatusCode,
    SyncPhase,
    Tick,
    Timing,
)
from dp_core.deviceplugin.sync import RULES, TRANSITIONS, Step

from core_builders import (
    QAT_RESOURCE,
    Kubelet,
    effects_of,
    live_node,
    one,
    qat_config,
    shared_group_host,
)

QAT_0, QAT_1, QAT_2 = "0000:3f:01.0", "0000:3f:01.1", "0000:3f:01.2"  # groups 40, 40, 41
POD = "7c1e4a9e-0000-4000-8000-000000000001"
TIMING = Timing(release_grace=30.0)


def checkpoint(*devices: str, pod: str = POD) -> KubeletCheckpoint:
    return KubeletCheckpoint((CheckpointEntry(pod, "compute", QAT_RESOURCE, devices),))


def wanted(effects: list[object]) -> list[bool]:
    """What the node told the shell, in order, of whether it wants the checkpoint."""
    return [e.wanted for e in effects if isinstance(e, KubeletCheckpointWanted)]


def health(node: StandardNode) -> dict[str, bool]:
    return {device.id: device.healthy for device in node.device_plugin.advertised(QAT_RESOURCE)}


def young_node(
    cp: KubeletCheckpoint, now: float = 0.0
) -> tuple[StandardNode, Kubelet, list[object]]:
    """dp up, its resources registered, and a kubelet that has just started with `cp`."""
    node, kubelet = live_node(qat_config(shared_devices=()), shared_group_host(), timing=TIMING)
    effects = node.handle(KubeletStarted(now, cp))
    kubelet.now = now
    effects += kubelet.register_all(effects)
    return node, kubelet, effects


# -- the table -----------------------------------------------------------------


def test_every_phase_change_is_in_the_table_and_nothing_else_is_allowed() -> None:
    assert TRANSITIONS[(SyncPhase.UNSEEN, Step.STARTED)] is SyncPhase.SYNCING
    assert TRANSITIONS[(SyncPhase.SYNCED, Step.STARTED)] is SyncPhase.SYNCING
    assert TRANSITIONS[(SyncPhase.SYNCING, Step.ACCOUNTED)] is SyncPhase.SYNCED
    # Only a syncing kubelet can become synced: an answer before kubelet.sock
    # is as young as the kubelet, and a synced one stays so until it restarts.
    assert TRANSITIONS[(SyncPhase.UNSEEN, Step.LISTED)] is SyncPhase.EARLY
    for phase in (SyncPhase.UNSEEN, SyncPhase.EARLY, SyncPhase.SYNCED):
        assert (phase, Step.ACCOUNTED) not in TRANSITIONS
        assert TRANSITIONS[(phase, Step.STARTED)] is SyncPhase.SYNCING
    for phase in (SyncPhase.EARLY, SyncPhase.SYNCED):
        assert TRANSITIONS[(phase, Step.LISTED)] is phase
    # What each phase allows: releases only on a trusted answer; binds on an
    # answer too before any kubelet.sock (nothing runs yet on a booting node);
    # holds and the fast polls only while syncing.
    assert [phase for phase in SyncPhase if RULES[phase].releases] == [SyncPhase.SYNCED]
    assert [phase for phase in SyncPhase if RULES[phase].binds] == [
        SyncPhase.EARLY,
        SyncPhase.SYNCED,
    ]
    assert [phase for phase in SyncPhase if RULES[phase].holds_unlisted] == [SyncPhase.SYNCING]
    assert [phase for phase in SyncPhase if RULES[phase].polls] == [SyncPhase.SYNCING]


# -- a young kubelet -------------------------------------------------------------


def test_the_siblings_of_a_device_the_checkpoint_names_are_held_until_it_is_listed() -> None:
    """The issue's fault: dp starts with the kubelet, which lists no pods yet.
    The kubelet's checkpoint gives QAT_0 to a pod: QAT_1, its group sibling,
    is Unhealthy; QAT_0 stays Healthy (the kubelet never gives it twice), and
    so does QAT_2, alone in its group."""
    node, kubelet, effects = young_node(checkpoint(QAT_0))
    assert node.device_plugin.sync.phase is SyncPhase.SYNCING
    assert health(node) == {QAT_0: True, QAT_1: False, QAT_2: True}
    (sibling,) = [d for d in node.device_plugin.advertised(QAT_RESOURCE) if d.id == QAT_1]
    assert sibling.reason == (
        f"IOMMU group 40 is held by a pod the kubelet has not listed yet: its checkpoint "
        f"gives {QAT_0} of {QAT_RESOURCE} to pod {POD}"
    )
    logs = {e.event: dict(e.fields) for e in effects_of(effects, Log)}
    assert logs["kubelet-syncing"]["held_groups"] == "40"
    assert logs["kubelet-started"]["checkpoint_entries"] == 1
    # The kubelet cannot give the sibling to a second pod.
    kubelet.now = 0.1
    rejected = one(kubelet.allocate(QAT_RESOURCE, (QAT_1,)), Reject)
    assert rejected.status is StatusCode.FAILED_PRECONDITION
    assert "has not listed yet" in rejected.message
    # A young answer lists nothing: nothing changes, and dp asks again.
    answer = node.handle(AllocationsObserved({}, 0.3))
    assert health(node) == {QAT_0: True, QAT_1: False, QAT_2: True}
    assert node.device_plugin.sync.phase is SyncPhase.SYNCING
    # ...sending a list again, so that the kubelet writes its checkpoint.
    nudge = one(answer, Publish)
    assert nudge.stream == kubelet.stream_of[QAT_RESOURCE]
    assert nudge.devices == node.device_plugin.advertised(QAT_RESOURCE)
    # The real list: the pod is adopted; the group stays held, by the pod now.
    synced = node.handle(AllocationsObserved({QAT_RESOURCE: frozenset({QAT_0})}, 1.4))
    assert node.device_plugin.sync.phase is SyncPhase.SYNCED
    assert health(node) == {QAT_0: True, QAT_1: False, QAT_2: True}
    assert effects_of(synced, HealthChanged) == []  # no flap on the way
    assert [[d.healthy for d in p.devices] for p in effects_of(synced, Publish)] == [
        [True, False, True]  # the sibling's reason names its new holder
    ]
    (allocation,) = node.device_plugin.allocations.all()
    assert allocation.device_ids == (QAT_0,)
    assert dict(
        one([e for e in synced if isinstance(e, Log) and e.event == "kubelet-synced"], Log).fields
    ) == {"after": 1.4, "held_back": "40"}


def test_a_pod_deleted_while_the_kubelet_was_down_frees_its_group_once_the_kubelet_drops_it() -> (
    None
):
    node, kubelet, started = young_node(checkpoint(QAT_0))
    assert wanted(started) == [True]
    # Synced, the kubelet lists no pod: the entry is stale, but only the
    # kubelet can say so, in its checkpoint, which dp's list makes it write.
    effects = node.handle(AllocationsObserved({}, 1.5))
    assert one(effects, Publish).resource == QAT_RESOURCE
    assert wanted(effects) == []  # still wanted: told once
    assert health(node)[QAT_1] is False
    freed = node.handle(KubeletCheckpointObserved(KubeletCheckpoint(), 1.55))
    assert node.device_plugin.sync.phase is SyncPhase.SYNCED
    # Trusted now: what it no longer lists is released at the next answer, asked at once.
    assert [r.reason for r in effects_of(freed, RefreshAllocations)] == [
        "the kubelet has synced its pods: which still hold devices"
    ]
    assert wanted(freed) == [False]
    assert health(node) == {QAT_0: True, QAT_1: True, QAT_2: True}
    report = one(freed, HealthChanged)
    assert (report.device_id, report.healthy) == (QAT_1, True)
    kubelet.now = 2.0
    assert effects_of(kubelet.allocate(QAT_RESOURCE, (QAT_1,)), Reply)


def test_a_device_alone_in_its_group_holds_nothing_back() -> None:
    node, _, effects = young_node(checkpoint(QAT_2))
    assert health(node) == {QAT_0: True, QAT_1: True, QAT_2: True}
    assert not node.device_plugin.allocations.unlisted_holds()
    assert wanted(effects) == []  # nothing a later write could change
    assert "kubelet-syncing" not in [e.event for e in effects_of(effects, Log)]
    # Nothing to account for: the first answer is trusted, listed or not.
    node.handle(AllocationsObserved({}, 0.3))
    assert node.device_plugin.sync.phase is SyncPhase.SYNCED


def test_devices_of_other_plugins_and_unknown_ids_are_not_ours_to_hold() -> None:
    cp = KubeletCheckpoint(
        (
            CheckpointEntry(POD, "c", "nvidia.com/gpu", (QAT_0,)),
            CheckpointEntry(POD, "c", QAT_RESOURCE, ("0000:99:00.0",)),
        )
    )
    node, _, _ = young_node(cp)
    assert health(node) == {QAT_0: True, QAT_1: True, QAT_2: True}


def test_the_device_the_checkpoint_names_can_be_given_again_once_the_kubelet_frees_it() -> None:
    """The kubelet purged the pod and hands QAT_0 to a new one: the Allocate
    says the kubelet no longer holds it, and the group is the new pod's."""
    node, kubelet, _ = young_node(checkpoint(QAT_0))
    kubelet.now = 2.0
    assert effects_of(kubelet.allocate(QAT_RESOURCE, (QAT_0,)), Reply)
    assert not node.device_plugin.allocations.unlisted_holds()
    assert node.ledger.holder(40) is not None
    assert health(node) == {QAT_0: True, QAT_1: False, QAT_2: True}


def test_nothing_is_released_on_the_word_of_a_kubelet_still_syncing() -> None:
    """A kubelet restart under a running dp that allocated QAT_0 long ago:
    the young kubelet lists nothing, and the allocation stays."""
    node, kubelet = live_node(qat_config(shared_devices=()), shared_group_host(), timing=TIMING)
    kubelet.now = 1.0
    kubelet.allocate(QAT_RESOURCE, (QAT_0,))
    node.handle(KubeletStarted(100.0, checkpoint(QAT_0)))
    for now in (100.3, 100.5, 101.0):
        assert effects_of(node.handle(AllocationsObserved({}, now)), HealthChanged) == []
    assert len(node.device_plugin.allocations) == 1 and health(node)[QAT_1] is False
    # Listed: synced; the allocation was dp's own, and stays.
    node.handle(AllocationsObserved({QAT_RESOURCE: frozenset({QAT_0})}, 101.3))
    assert (
        node.device_plugin.sync.phase is SyncPhase.SYNCED
        and len(node.device_plugin.allocations) == 1
    )
    # Gone: released as ever.
    node.handle(AllocationsObserved({}, 140.0))
    assert len(node.device_plugin.allocations) == 0 and health(node)[QAT_1] is True


def test_an_unreadable_checkpoint_holds_every_shared_group_until_it_can_be_read() -> None:
    problem = "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint: not JSON"
    node, _, effects = young_node(KubeletCheckpoint(problem=problem))
    logs = effects_of(effects, Log)
    warning = one([e for e in logs if e.event == "kubelet-checkpoint-unreadable"], Log)
    assert warning.level == "warning"
    assert dict(warning.fields)["reason"] == problem
    assert health(node) == {QAT_0: False, QAT_1: False, QAT_2: True}
    assert wanted(effects) == [True]
    assert wanted(node.handle(AllocationsObserved({}, 0.5))) == []
    assert node.device_plugin.sync.phase is SyncPhase.SYNCING  # an answer alone does not do
    assert wanted(node.handle(KubeletCheckpointObserved(KubeletCheckpoint(), 0.6))) == [False]
    assert health(node) == {QAT_0: True, QAT_1: True, QAT_2: True}
    node.handle(AllocationsObserved({}, 0.8))
    assert node.device_plugin.sync.phase is SyncPhase.SYNCED


def test_a_checkpoint_with_entries_and_a_problem_is_refused() -> None:
    with pytest.raises(ValueError, match="unreadable"):
        KubeletCheckpoint(checkpoint(QAT_0).entries, "bad")


def test_dp_asks_again_at_the_sync_pace_until_it_can_trust_the_answer() -> None:
    node, _, _ = young_node(checkpoint(QAT_0), now=10.0)
    assert node.next_deadline() == pytest.approx(10.2)
    assert effects_of(node.handle(Tick(10.1)), RefreshAllocations) == []
    asked = effects_of(node.handle(Tick(10.2)), RefreshAllocations)
    assert [a.reason for a in asked] == ["the kubelet is syncing its pods: which pods hold devices"]
    assert node.next_deadline() == pytest.approx(10.4)
    # A kubelet syncing for half a minute (its API server out of reach) is asked less often.
    node.handle(Tick(41.0))
    assert node.next_deadline() == pytest.approx(43.0)
    node.handle(AllocationsObserved({QAT_RESOURCE: frozenset({QAT_0})}, 43.0))
    # Synced: no more asks at the sync's pace; the allocation it adopted is
    # asked about once its release grace is over (HeldPolls).
    assert node.next_deadline() == pytest.approx(43.0 + TIMING.release_grace)
    assert node.device_plugin.polls.next_at() == node.next_deadline()


def test_a_kubelet_restart_starts_over() -> None:
    node, _, _ = young_node(checkpoint(QAT_0))
    node.handle(KubeletCheckpointObserved(KubeletCheckpoint(), 1.0))
    node.handle(AllocationsObserved({}, 1.0))
    assert node.device_plugin.sync.phase is SyncPhase.SYNCED and health(node)[QAT_1] is True
    node.handle(KubeletStarted(50.0, checkpoint(QAT_1)))
    assert node.device_plugin.sync.phase is SyncPhase.SYNCING
    assert health(node) == {QAT_0: False, QAT_1: True, QAT_2: True}


def test_the_shell_is_told_each_time_the_checkpoint_becomes_wanted_or_stops_being() -> None:
    """`KubeletCheckpointWanted` with the input that changed whether a write
    of the checkpoint could change what is held, and with no other: the
    shell reads the file only while it is wanted."""
    node, _, started = young_node(checkpoint(QAT_0))
    assert wanted(started) == [True]  # QAT_0's pod is not listed yet
    table: list[tuple[object, list[bool]]] = [
        (AllocationsObserved({}, 0.3), []),  # a young answer: still in doubt
        (Tick(0.4), []),
        (KubeletCheckpointObserved(checkpoint(QAT_0), 0.5), []),  # the same entry
        (KubeletCheckpointObserved(KubeletCheckpoint(), 0.6), [False]),  # dropped: synced
        (AllocationsObserved({}, 0.8), []),
        (KubeletStarted(50.0, checkpoint(QAT_1)), [True]),  # a kubelet restart: in doubt again
        (KubeletStarted(51.0, checkpoint(QAT_1)), []),  # and again: nothing changed
        (AllocationsObserved({QAT_RESOURCE: frozenset({QAT_1})}, 52.0), [False]),  # listed
        (KubeletStarted(60.0, checkpoint(QAT_2)), []),  # alone in its group: not in doubt
    ]
    for event, expected in table:
        assert wanted(node.handle(event)) == expected, event  # type: ignore[arg-type]


def test_binds_wait_until_the_answer_can_be_trusted() -> None:
    node = StandardNode(qat_config(shared_devices=()))
    node.handle(HostObserved(shared_group_host(), 0.0))
    assert not node.device_plugin.sync.rules.binds
    # Before kubelet.sock, an answer lets binds start (dp started before the
    # kubelet's device manager: nothing runs on the node yet)...
    node.handle(AllocationsObserved({}, 0.1))
    assert node.device_plugin.sync.phase is SyncPhase.EARLY and node.device_plugin.sync.rules.binds
    # ...but once a kubelet started, they wait for its answers to be trusted.
    node.handle(KubeletStarted(0.2, checkpoint(QAT_0)))
    node.handle(AllocationsObserved({}, 0.4))
    assert not node.device_plugin.sync.rules.binds
    node.handle(AllocationsObserved({QAT_RESOURCE: frozenset({QAT_0})}, 1.0))
    assert node.device_plugin.sync.rules.binds


# -- any order of events -------------------------------------------------------------


@attrs.define
class KubeletModel:
    """The kubelet's device manager and pod sources, as dp sees them from outside.

    pkg/kubelet/cm/devicemanager/manager.go: `podDevices` is read back from
    the checkpoint at start; pods not active are dropped from it only once
    every source has been seen (`UpdateAllocatedDevices`, at `List` and at
    each allocation); the checkpoint is written at each device list and each
    allocation; a device in `podDevices` is never given out.
    server_v1.go: `List` shows the active pods the pod manager has, which
    before the sources are seen is some of them, or none.
    """

    pod_devices: dict[str, tuple[str, ...]] = attrs.Factory(dict)  # pod UID -> devices
    running: set[str] = attrs.Factory(set)  # pods the API server still has
    pod_manager: set[str] = attrs.Factory(set)
    synced: bool = True
    checkpoint: KubeletCheckpoint = KubeletCheckpoint()

    def restart(self) -> None:
        self.synced = False
        self.pod_manager = set()
        self.pod_devices = {e.pod_uid: e.device_ids for e in self.checkpoint.entries}

    def sync(self) -> None:
        self.synced = True
        self.pod_manager = set(self.running)

    def _purge(self) -> None:
        if self.synced:
            for uid in [uid for uid in self.pod_devices if uid not in self.running]:
                del self.pod_devices[uid]

    def list(self, seen: set[str]) -> dict[str, frozenset[str]]:
        self._purge()
        pods = self.pod_manager if self.synced else self.pod_manager | (seen & self.running)
        self.pod_manager = set(pods)
        held = {d for uid in pods for d in self.pod_devices.get(uid, ())}
        return {QAT_RESOURCE: frozenset(held)} if held else {}

    def write(self) -> None:
        entries = tuple(
            CheckpointEntry(uid, "compute", QAT_RESOURCE, devices)
            for uid, devices in sorted(self.pod_devices.items())
        )
        self.checkpoint = KubeletCheckpoint(entries)

    def in_use(self) -> set[str]:
        self._purge()
        return {d for devices in self.pod_devices.values() for d in devices}


GROUP_OF = {QAT_0: 40, QAT_1: 40, QAT_2: 41}
ACTIONS = ("kubelet", "dp", "both", "list", "sync", "admit", "admit", "delete", "tick")


class World:
    def __init__(self, data: st.DataObject) -> None:
        self.data = data
        self.kubelet = KubeletModel()
        self.now = 0.0
        self.uids = (f"pod-{n}" for n in itertools.count())
        self.checkpoint_wanted = False
        self.node, self.driver = self._dp()

    def _dp(self) -> tuple[StandardNode, Kubelet]:
        """A dp process starting: it registers once it sees kubelet.sock (`start_kubelet`)."""
        node = StandardNode(qat_config(shared_devices=()), timing=TIMING)
        self.checkpoint_wanted = False  # a new process has been told nothing yet
        self._told(node.handle(HostObserved(shared_group_host(), self.now)))
        return node, Kubelet(node, self.now)

    def _told(self, effects: list[Effect]) -> list[Effect]:
        """`effects`, after following what they say of the checkpoint, as dp's shell does."""
        for told in effects_of(effects, KubeletCheckpointWanted):
            self.checkpoint_wanted = told.wanted
        return effects

    def feed(self, event: object) -> list[object]:
        effects: list[Effect] = self._told(self.node.handle(event))  # type: ignore[arg-type]
        # Every list a plugin sends makes the kubelet write its checkpoint.
        if effects_of(effects, Publish):
            self.kubelet.write()
            if self.checkpoint_wanted:
                effects += self._told(
                    self.node.handle(KubeletCheckpointObserved(self.kubelet.checkpoint, self.now))
                )
        return list(effects)

    def start_kubelet(self) -> None:
        effects = self.feed(KubeletStarted(self.now, self.kubelet.checkpoint))
        self.driver.now = self.now
        self._told(self.driver.register_all(effects))  # type: ignore[arg-type]

    def step(self, action: str) -> None:
        self.now += self.data.draw(st.sampled_from([0.0, 0.1, 0.3, 2.0, 31.0]))
        self.driver.now = self.now
        kubelet = self.kubelet
        if action in ("kubelet", "both"):
            kubelet.restart()
        if action in ("dp", "both"):
            self.node, self.driver = self._dp()
        if action in ("kubelet", "dp", "both"):
            self.start_kubelet()
        elif action == "list":
            seen = set(self.data.draw(st.sets(st.sampled_from(sorted(kubelet.running) or [""]))))
            self.feed(AllocationsObserved(kubelet.list(seen), self.now))
        elif action == "sync":
            kubelet.sync()
        elif action == "admit" and kubelet.synced:
            free = [
                d.id
                for d in self.node.device_plugin.advertised(QAT_RESOURCE)
                if d.healthy and d.id not in kubelet.in_use()
            ]
            if free:
                device = self.data.draw(st.sampled_from(free))
                answer = self._told(self.driver.allocate(QAT_RESOURCE, (device,)))
                if effects_of(answer, Reply):
                    uid = next(self.uids)
                    kubelet.pod_devices[uid] = (device,)
                    kubelet.running.add(uid)
                    kubelet.pod_manager.add(uid)
                    kubelet.write()
        elif action == "delete" and kubelet.running:
            uid = self.data.draw(st.sampled_from(sorted(kubelet.running)))
            kubelet.running.discard(uid)
            kubelet.pod_manager.discard(uid)
        elif action == "tick":
            self.feed(Tick(self.now))

    def holders(self) -> dict[int, set[str]]:
        """IOMMU group -> the running pods whose devices are in it."""
        found: dict[int, set[str]] = {}
        for uid in self.kubelet.running:
            for device in self.kubelet.pod_devices.get(uid, ()):
                found.setdefault(GROUP_OF[device], set()).add(uid)
        return found


@settings(max_examples=300)
@given(st.data())
def test_no_group_is_ever_split_whatever_the_order_of_starts_and_answers(
    data: st.DataObject,
) -> None:
    world = World(data)
    world.start_kubelet()
    for _ in range(data.draw(st.integers(1, 25))):
        world.step(data.draw(st.sampled_from(ACTIONS)))
        split = {group: pods for group, pods in world.holders().items() if len(pods) > 1}
        assert not split, f"IOMMU groups split between pods: {split}"
        # What the shell was told is what the node wants, whatever happened.
        assert world.checkpoint_wanted == world.node.device_plugin.sync.wants_checkpoint
    # And once the kubelet has synced and answered, nothing stays held back
    # that no running pod holds.
    world.kubelet.sync()
    world.now += 31.0  # past the release grace of allocations whose pods are gone
    for _ in range(2):
        world.feed(AllocationsObserved(world.kubelet.list(set()), world.now))
        world.now += 0.3
    assert world.node.device_plugin.sync.phase is SyncPhase.SYNCED
    assert not world.node.device_plugin.allocations.unlisted_holds()
    held = {GROUP_OF[d] for uid in world.kubelet.running for d in world.kubelet.pod_devices[uid]}
    unhealthy = {
        GROUP_OF[d.id] for d in world.node.device_plugin.advertised(QAT_RESOURCE) if not d.healthy
    }
    assert unhealthy <= held


def test_metrics_show_the_sync_phase_and_the_groups_held_for_unlisted_pods() -> None:
    from dp_core import collect

    def gauges(node: StandardNode) -> dict[str, object]:
        families = {family.name: family for family in collect(node)}
        phase = families["dp_kubelet_sync_phase"]
        (held,) = families["dp_iommu_groups_held_for_unlisted_pods"].samples
        current = [dict(s.labels)["phase"] for s in phase.samples if s.value == 1]
        return {"phase": current, "held": held.value, "phases": len(phase.samples)}

    node, _, _ = young_node(checkpoint(QAT_0))
    node.handle(AllocationsObserved({}, 0.1))  # young: lists no pods
    assert gauges(node) == {"phase": ["syncing"], "held": 1, "phases": len(SyncPhase)}
    node.handle(AllocationsObserved({QAT_RESOURCE: frozenset({QAT_0})}, 0.2))
    assert gauges(node) == {"phase": ["synced"], "held": 0, "phases": len(SyncPhase)}
