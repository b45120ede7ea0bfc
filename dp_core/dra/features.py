"""Which DRA features the pool uses: shared counters and device taints.

The config's `dra.partitionableDevices`/`dra.deviceTaints` decide when true
or false; with "auto", what the API server showed it keeps
(`DraFeaturesObserved`: the shell asks with a server-side dry run before it
writes the pool, and again later, and compares every write). Until then the
pool is computed as if the cluster had both, but the shell writes nothing
before it has asked. A finding is logged when it is new or changes; a server
that cannot be asked counts as lacking what was not seen yet.
"""

from __future__ import annotations

from ..config.config import Dra, DraFeatureSetting
from ..log import Log
from .inputs import DraFeaturesObserved

__all__ = ["Features"]

_PARTITIONABLE = "partitionable"
_TAINTS = "device_taints"
# feature -> (its gate, the fields, its config key, what dp publishes without it)
_FEATURES = {
    _PARTITIONABLE: (
        "DRAPartitionableDevices",
        "sharedCounters",
        "dra.partitionableDevices",
        "publishing one device per multi-device IOMMU group",
    ),
    _TAINTS: (
        "DRADeviceTaints",
        "device taints",
        "dra.deviceTaints",
        "leaving unhealthy devices, and devices whose IOMMU group is held elsewhere, "
        "out of the pool instead of tainting them NoSchedule",
    ),
}


class Features:
    """The features the pool is computed with, and what the API server showed."""

    def __init__(self, partitionable: bool, device_taints: bool) -> None:
        # What "auto" computes until the API server has shown what it keeps:
        # the rich pool, which the shell holds back until it has asked.
        self._assumed = {_PARTITIONABLE: partitionable, _TAINTS: device_taints}
        self._observed: dict[str, bool] = {}
        self._guessed: set[str] = set()  # taken as absent: the server could not be asked
        self._settings: dict[str, DraFeatureSetting] = {_PARTITIONABLE: "auto", _TAINTS: "auto"}

    @property
    def partitionable(self) -> bool:
        """Whether the pool has a shared counter per multi-device IOMMU group."""
        return self._feature(_PARTITIONABLE)

    @property
    def device_taints(self) -> bool:
        """Whether devices that cannot be allocated now are tainted rather than left out."""
        return self._feature(_TAINTS)

    def _feature(self, feature: str) -> bool:
        setting = self._settings[feature]
        if isinstance(setting, bool):
            return setting
        return self._observed.get(feature, self._assumed[feature])

    def configure(self, settings: Dra) -> None:
        """The config's word on each feature."""
        self._settings = {
            _PARTITIONABLE: settings.partitionable_devices,
            _TAINTS: settings.device_taints,
        }

    def observed(self, event: DraFeaturesObserved) -> list[Log]:
        """Follow what the API server showed of its features: a log once per finding."""
        logs: list[Log] = []
        for feature, seen in (
            (_PARTITIONABLE, event.partitionable),
            (_TAINTS, event.device_taints),
        ):
            if seen is None:
                if event.unknown is not None and feature not in self._observed:
                    self._observed[feature] = False
                    self._guessed.add(feature)
                    logs.append(_unknown_log(feature, event.unknown, self._settings[feature]))
                continue
            if self._observed.get(feature) == seen and feature not in self._guessed:
                continue
            self._observed[feature] = seen
            self._guessed.discard(feature)
            logs.append(_feature_log(feature, seen, self._settings[feature]))
        return logs


def _feature_log(feature: str, kept: bool, setting: DraFeatureSetting) -> Log:
    gate, fields, key, without = _FEATURES[feature]
    if kept:
        return Log.info(
            "dra-feature-found",
            feature=gate,
            detail=f"the API server kept {fields}: the cluster has {gate}",
        )
    dropped = f"the API server dropped {fields}"
    if setting is True:
        detail = (
            f"{dropped}, so the cluster lacks {gate}; {key} is true, so dp keeps "
            "publishing them, and the scheduler does not see them"
        )
    else:
        detail = f"{dropped} ({gate} is off): {without}"
    return Log.warning("dra-feature-missing", feature=gate, detail=detail)


def _unknown_log(feature: str, why: str, setting: DraFeatureSetting) -> Log:
    gate, _, key, without = _FEATURES[feature]
    if isinstance(setting, bool):
        detail = f"cannot ask the API server whether it has {gate} ({why}); {key} decides"
    else:
        detail = (
            f"cannot ask the API server whether it has {gate} ({why}): taking it as off, {without}"
        )
    return Log.warning("dra-feature-unknown", feature=gate, detail=detail)
