"""What the kubelet's device-manager checkpoint says pods were given, as values.

The kubelet keeps `kubelet_internal_checkpoint` in its device-plugin
directory: one entry per (pod, container, resource) with the device IDs it
allocated (pkg/kubelet/cm/devicemanager/checkpoint/checkpoint.go,
`PodDevicesEntry`). The shell reads the file; these are what it hands the
core (`KubeletStarted`, `KubeletCheckpointObserved`).
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

__all__ = ["CheckpointEntry", "KubeletCheckpoint"]


def _ids(value: object) -> tuple[str, ...]:
    return tuple(str(item) for item in value)  # type: ignore[attr-defined]


@attrs.frozen
class CheckpointEntry:
    """The devices of one resource the kubelet gave one container of one pod."""

    pod_uid: str
    container: str
    resource: str
    device_ids: tuple[str, ...] = attrs.field(converter=_ids)


def _entries(value: Iterable[CheckpointEntry]) -> tuple[CheckpointEntry, ...]:
    return tuple(value)


@attrs.frozen
class KubeletCheckpoint:
    """The checkpoint as last read: its entries, or why it could not be read.

    No file is an empty checkpoint: the kubelet writes it at every device
    list a plugin sends, so a kubelet that has none has given nothing out.
    """

    entries: tuple[CheckpointEntry, ...] = attrs.field(default=(), converter=_entries)
    # Why it could not be read (naming the file); `entries` is then empty.
    problem: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.problem is not None and self.entries:
            raise ValueError("an unreadable checkpoint has no entries")
