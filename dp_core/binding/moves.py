"""A function dp moved to vfio-pci itself, as remembered across restarts (docs/design.md §6)."""

from __future__ import annotations

import attrs

from ..config.config import driver_name_error
from ..host.pci import PciAddress

__all__ = ["Move"]


@attrs.frozen
class Move:
    """A function dp moved to vfio-pci itself: the driver it took it from
    (None: it had none) and its IOMMU group, which give-backs need; `pinned`
    when its driver_override named that driver (`BindingFinished.pinned`)."""

    address: PciAddress
    # It reaches a sysfs path (drivers/<driver>/bind) when given back.
    driver: str | None = attrs.field()
    iommu_group: int | None
    pinned: bool = attrs.field(default=False, kw_only=True)

    @driver.validator
    def _check_driver(self, attribute: attrs.Attribute[str | None], value: str | None) -> None:
        error = None if value is None else driver_name_error(value)
        if error is not None:
            raise ValueError(error)
