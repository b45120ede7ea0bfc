"""One device as a front end offers it (docs/design.md §5), or why it is not offered."""

from __future__ import annotations

import attrs

__all__ = ["AdvertisedDevice", "SkippedDevice"]


@attrs.frozen
class AdvertisedDevice:
    """One device of a resource as the kubelet will see it.

    `id` is the PCI address, the mdev UUID or a generated shared-device ID.
    `host_paths` are the device nodes a container needs for it.
    """

    id: str
    healthy: bool
    numa_node: int | None = None
    iommu_group: int | None = None
    reason: str = ""
    host_paths: tuple[str, ...] = ()
    driver: str | None = None

    @property
    def health(self) -> str:
        return "Healthy" if self.healthy else "Unhealthy"


@attrs.frozen
class SkippedDevice:
    """A device that was seen and deliberately not advertised, and why."""

    id: str
    reason: str
    resource_name: str | None = None
    driver: str | None = None
