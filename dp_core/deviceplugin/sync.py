"""Whether what the kubelet's PodResources API lists can be trusted yet.

A kubelet that has just started answers `List` before it has synced its
pods: its podresources server starts beside its main loop
(cmd/kubelet/app/server.go, `startKubelet`), and `List` reports the active
pods of its pod manager (pkg/kubelet/apis/podresources/server_v1.go), which
has none until the first update from each pod source has been handled
(pkg/kubelet/kubelet.go, `syncLoopIteration`, which marks a source seen only
after `HandlePodAdditions`). Its device manager knows more from the start: it
reads back `kubelet_internal_checkpoint` before it serves kubelet.sock, keeps
every device named there allocated, and drops the entries of pods that are
not active only once every source has been seen
(pkg/kubelet/cm/devicemanager/manager.go: `Start`, `UpdateAllocatedDevices`,
which `List` and every allocation call). It writes the file again at every
device list a plugin sends and every allocation (`writeCheckpoint`).

So from a kubelet start (`SYNCING`), a device the checkpoint names that
`List` does not show may belong to a pod the kubelet has not listed yet:

- the device's IOMMU group is held (its siblings are advertised Unhealthy),
  but only a group of two or more: a device alone in its group cannot be
  split, and the kubelet never gives one device ID to two pods, so the
  device itself is left as it is;
- nothing is released on `List`'s word, and `List` is asked again every
  `Timing.sync_poll`;
- after each answer that leaves such a device, the node sends a device list
  again (a `Publish` of what it published), so that the kubelet writes its
  checkpoint and shows what it has dropped since.

The answer is trusted (`SYNCED`) once every such device is listed, or is no
longer in the checkpoint. An unreadable checkpoint holds every group of two
or more until it can be read. An answer before any kubelet.sock (`EARLY`: dp
started before the kubelet's device manager, as on a booting node, where no
VM runs yet) lets moves to vfio-pci start, as any answer did before; nothing
is released on it. Which phase allows what is `RULES`; every
phase change goes through `TRANSITIONS`, and nothing else assigns a phase.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Mapping

import attrs

from ..errors import UsageError
from ..inventory.advertised import AdvertisedDevice
from ..ledger import Ledger
from ..log import Log
from ..timing import Timing
from .allocations import Allocation, AllocationBook, allocation_log
from .checkpoint import KubeletCheckpoint
from .effects import RefreshAllocations

Effect = Log | RefreshAllocations

__all__ = [
    "POLL",
    "SYNCED_POLL",
    "RULES",
    "TRANSITIONS",
    "Answered",
    "DeviceOf",
    "KubeletSync",
    "PhaseRules",
    "Step",
    "SyncPhase",
]

POLL = RefreshAllocations("the kubelet is syncing its pods: which pods hold devices")
SYNCED_POLL = RefreshAllocations("the kubelet has synced its pods: which still hold devices")


class SyncPhase(enum.Enum):
    UNSEEN = "unseen"  # no kubelet.sock seen yet
    # PodResources answered, and there is no kubelet.sock yet: dp started
    # before the kubelet's device manager (a node booting), so no pod can
    # hold a device dp gave, and no VM runs.
    EARLY = "early"
    SYNCING = "syncing"  # a kubelet started; List may leave out pods that hold devices
    SYNCED = "synced"  # List shows every pod that holds a device


class Step(enum.Enum):
    STARTED = "started"  # kubelet.sock appeared, or was made again
    READ = "read"  # the checkpoint was read
    LISTED = "listed"  # PodResources answered List
    ACCOUNTED = "accounted"  # every device the checkpoint names is listed, or gone from it


TRANSITIONS: dict[tuple[SyncPhase, Step], SyncPhase] = {
    (SyncPhase.UNSEEN, Step.STARTED): SyncPhase.SYNCING,
    (SyncPhase.EARLY, Step.STARTED): SyncPhase.SYNCING,
    (SyncPhase.SYNCING, Step.STARTED): SyncPhase.SYNCING,
    (SyncPhase.SYNCED, Step.STARTED): SyncPhase.SYNCING,
    # The kubelet serves PodResources before kubelet.sock: an answer may
    # come first, and is as young as the kubelet.
    (SyncPhase.UNSEEN, Step.LISTED): SyncPhase.EARLY,
    (SyncPhase.EARLY, Step.LISTED): SyncPhase.EARLY,
    (SyncPhase.SYNCING, Step.LISTED): SyncPhase.SYNCING,
    (SyncPhase.SYNCED, Step.LISTED): SyncPhase.SYNCED,
    # The file changes at every device list; it matters only while syncing.
    (SyncPhase.UNSEEN, Step.READ): SyncPhase.UNSEEN,
    (SyncPhase.EARLY, Step.READ): SyncPhase.EARLY,
    (SyncPhase.SYNCING, Step.READ): SyncPhase.SYNCING,
    (SyncPhase.SYNCED, Step.READ): SyncPhase.SYNCED,
    (SyncPhase.SYNCING, Step.ACCOUNTED): SyncPhase.SYNCED,
}


@attrs.frozen
class PhaseRules:
    # A List answer ends the reservations of devices it no longer shows.
    releases: bool
    # Groups of devices the checkpoint names and List does not show are held.
    holds_unlisted: bool
    # List is asked every `Timing.sync_poll`, whatever else is going on.
    polls: bool
    # Moves to vfio-pci may start (they wait to know which groups pods hold).
    binds: bool


RULES: dict[SyncPhase, PhaseRules] = {
    SyncPhase.UNSEEN: PhaseRules(releases=False, holds_unlisted=False, polls=False, binds=False),
    # Moves may start as they always could once PodResources had answered;
    # what it lists is adopted, and nothing is released on its word.
    SyncPhase.EARLY: PhaseRules(releases=False, holds_unlisted=False, polls=False, binds=True),
    SyncPhase.SYNCING: PhaseRules(releases=False, holds_unlisted=True, polls=True, binds=False),
    SyncPhase.SYNCED: PhaseRules(releases=True, holds_unlisted=False, polls=False, binds=True),
}

#: The device (resource, ID) names in the node's inventory, if any.
DeviceOf = Callable[[str, str], "AdvertisedDevice | None"]


@attrs.frozen
class Settled:
    """What `KubeletSync.settle` changed: groups whose holder changed, and the
    effects that go with it (log lines; a poll when it synced)."""

    touched: frozenset[int] = frozenset()
    effects: tuple[Effect, ...] = ()


@attrs.frozen
class Answered:
    """What a PodResources answer did to the ledger (`KubeletSync.answered`)."""

    # Allocations adopted and released, groups found split (in that order),
    # then how the sync went on.
    effects: tuple[Effect, ...]
    touched: frozenset[int]
    released: tuple[Allocation, ...]


@attrs.define
class _Unlisted:
    resource: str
    device_ids: list[str]
    pods: list[str]


class KubeletSync:
    """The phase, what the checkpoint and List said since the kubelet started,
    and the groups held meanwhile (in the front end's `AllocationBook`)."""

    def __init__(
        self,
        book: AllocationBook,
        ledger: Ledger,
        timing: Timing,
        device_of: DeviceOf,
        shared_groups: Callable[[], Collection[int]],
    ) -> None:
        self._book = book
        self._ledger = ledger
        self._timing = timing
        self._device_of = device_of
        # The groups of two or more members dp offers: only they can be split.
        self._shared_groups = shared_groups
        self._splits: set[str] = set()  # groups found split, as last logged
        self.phase = SyncPhase.UNSEEN
        self.started_at: float | None = None
        self.next_poll: float | None = None  # while syncing: when to ask List again
        self._checkpoint: KubeletCheckpoint | None = None
        self._listed: Mapping[str, frozenset[str]] | None = None
        self.held_back: set[int] = set()  # every group held during this sync, for the log
        # A resource with a device still unaccounted for: where a device list
        # sent again makes the kubelet write its checkpoint (`nudge_resource`).
        self.nudge_resource: str | None = None
        # Whether a device is in doubt, or the checkpoint could not be read:
        # only then can a new write of it change anything (`wants_checkpoint`).
        self._in_doubt = False
        self._logged_holds: frozenset[int] = frozenset()
        self._logged_problem: str | None = None

    @property
    def rules(self) -> PhaseRules:
        return RULES[self.phase]

    @property
    def trusted(self) -> bool:
        return self.phase is SyncPhase.SYNCED

    @property
    def wants_checkpoint(self) -> bool:
        """Whether the kubelet's next checkpoint write should be read: while it
        syncs, and a device is in doubt or the last one could not be read.
        Devices the node gives out meanwhile it knows from their Allocate."""
        return self.rules.holds_unlisted and self._in_doubt

    @property
    def checkpoint(self) -> KubeletCheckpoint | None:
        """The checkpoint as last read since the kubelet started (None before)."""
        return self._checkpoint

    def _move(self, step: Step) -> None:
        try:
            self.phase = TRANSITIONS[(self.phase, step)]
        except KeyError:
            phase = self.phase.value
            raise UsageError(f"kubelet sync: no transition from {phase} on {step.value}") from None

    # -- what happened -----------------------------------------------------------

    def started(self, checkpoint: KubeletCheckpoint, now: float) -> None:
        self._move(Step.STARTED)
        self.started_at = now
        self._checkpoint = checkpoint
        self._listed = None  # an answer from before is the old kubelet's
        self.held_back = set()
        self._logged_problem = None
        self.next_poll = now + self.poll_step(now)

    def read(self, checkpoint: KubeletCheckpoint) -> None:
        self._move(Step.READ)
        if self.phase is SyncPhase.SYNCING:
            self._checkpoint = checkpoint

    def answered(self, held: Mapping[str, frozenset[str]], now: float) -> Answered:
        """A PodResources answer: what it lists is held (adopted, whatever the
        phase), and once it can be trusted what it does not list is released."""
        self._move(Step.LISTED)
        if self.phase is SyncPhase.SYNCING:
            self._listed = held
        book, logs = self._book, []
        touched: set[int] = set()
        splits: set[str] = set()
        for resource, ids in sorted(held.items()):
            known = [self._device_of(resource, device_id) for device_id in sorted(ids)]
            adopted, split = book.adopt(resource, [d for d in known if d is not None], now)
            logs += [allocation_log("adopted", allocation) for allocation in adopted]
            touched.update(group for allocation in adopted for group in allocation.groups)
            splits.update(split)
        logs += [Log.error("group-split", detail=split) for split in sorted(splits - self._splits)]
        self._splits = splits  # logged once each, while it lasts
        settled = self.settle(now, answering=True)
        released = book.release_unheld(held, now) if self.rules.releases else []
        logs += [allocation_log("released", allocation) for allocation in released]
        touched.update(group for allocation in released for group in allocation.groups)
        return Answered(
            (*logs, *settled.effects), frozenset(touched | settled.touched), tuple(released)
        )

    def poll_step(self, now: float) -> float:
        timing = self._timing
        young = self.started_at is None or now - self.started_at < timing.sync_poll_fast_for
        return timing.sync_poll if young else timing.sync_poll_slow

    def poll_due(self, now: float) -> list[Effect]:
        """`POLL` when List should be asked now (and the next time set)."""
        if not self.rules.polls or self.next_poll is None or now < self.next_poll:
            return []
        self.next_poll = now + self.poll_step(now)
        return [POLL]

    # -- what follows --------------------------------------------------------------

    def _unaccounted(self) -> dict[int, _Unlisted]:
        """Group -> the devices in it the checkpoint names and List does not show."""
        checkpoint, listed = self._checkpoint, self._listed or {}
        shared = self._shared_groups()
        found: dict[int, _Unlisted] = {}
        if checkpoint is None:
            return found
        for entry in checkpoint.entries:
            shown = listed.get(entry.resource, frozenset())
            for device_id in entry.device_ids:
                if device_id in shown:
                    continue
                device = self._device_of(entry.resource, device_id)
                group = device.iommu_group if device is not None else None
                if group is None or group not in shared:
                    continue  # not dp's, or alone in its group
                unlisted = found.setdefault(group, _Unlisted(entry.resource, [], []))
                if entry.resource == unlisted.resource and device_id not in unlisted.device_ids:
                    unlisted.device_ids.append(device_id)
                if entry.pod_uid not in unlisted.pods:
                    unlisted.pods.append(entry.pod_uid)
        return found

    def settle(self, now: float, *, answering: bool = False) -> Settled:
        """Move to SYNCED if nothing is unaccounted for, and bring the held
        groups in line with what is (every group of two or more members while
        the checkpoint cannot be read). Synced by a checkpoint the kubelet
        wrote (not `answering` a List), it asks List again at once: what it
        no longer lists can be released now, not at the next regular poll."""
        touched: set[int] = set()
        unaccounted: dict[int, _Unlisted] = {}
        logs: list[Effect] = []
        problem = self._checkpoint.problem if self._checkpoint is not None else None
        if self.phase is SyncPhase.SYNCING:
            unaccounted = self._unaccounted()
            if problem is not None and problem != self._logged_problem:
                effect = "every IOMMU group of two or more devices is held until it can be read"
                logs.append(
                    Log.warning("kubelet-checkpoint-unreadable", reason=problem, effect=effect)
                )
            self._logged_problem = problem
            if self._checkpoint is not None and problem is None and self._listed is not None:
                if not unaccounted:
                    self._move(Step.ACCOUNTED)
                    self.next_poll = None
                    started = self.started_at if self.started_at is not None else now
                    held_back = ",".join(map(str, sorted(self.held_back))) or "none"
                    logs.append(
                        Log.info(
                            "kubelet-synced", after=round(now - started, 3), held_back=held_back
                        )
                    )
                    if not answering:
                        logs.append(SYNCED_POLL)
        wanted: dict[int, tuple[str, tuple[str, ...], str]] = {}
        if self.rules.holds_unlisted:
            if problem is not None:
                why = f"a pod the kubelet may not have listed yet ({problem})"
                wanted = {group: ("", (), why) for group in self._shared_groups()}
            for group, unlisted in unaccounted.items():
                pods = ", ".join(unlisted.pods)
                why = (
                    f"a pod the kubelet has not listed yet: its checkpoint gives "
                    f"{', '.join(unlisted.device_ids)} of {unlisted.resource} to pod {pods}"
                )
                wanted[group] = (unlisted.resource, tuple(unlisted.device_ids), why)
        book = self._book
        for group, hold in list(book.unlisted_holds().items()):
            want = wanted.get(group)
            if want is None or (hold.resource, hold.device_ids, hold.why) != want:
                book.release_unlisted(group)
                touched.add(group)
        for group, (resource, device_ids, why) in sorted(wanted.items()):
            if self._ledger.holder(group) is None:
                book.hold_unlisted(group, resource, device_ids, why, now)
                touched.add(group)
                self.held_back.add(group)
        held = frozenset(book.unlisted_holds())
        if held and held != self._logged_holds:
            logs.insert(
                0,
                Log.info(
                    "kubelet-syncing",
                    held_groups=",".join(map(str, sorted(held))),
                    until="PodResources lists the pods the kubelet's checkpoint gives their "
                    "devices to, or the kubelet drops them from it",
                ),
            )
        self._logged_holds = held
        first = next(iter(unaccounted.values()), None)
        self.nudge_resource = first.resource if first is not None and problem is None else None
        self._in_doubt = bool(unaccounted) or problem is not None
        return Settled(frozenset(touched), tuple(logs))
