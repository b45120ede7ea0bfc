"""The front ends a server runs: one line each.

Each entry makes a front end's wiring (`FrontendRuntime`) from the settings,
the config and the node's ledger, or None when the config leaves that front
end off. A new front end is its core package, its wiring, and one line here.
"""

from __future__ import annotations

from collections.abc import Callable

from dp_core import Config, Ledger
from dp_server.config.settings import Settings
from dp_server.deviceplugin.wiring import DevicePluginRuntime
from dp_server.loop import FrontendRuntime

__all__ = ["FRONTENDS", "Plug"]

#: How a front end's wiring is made: None when the config leaves it off.
Plug = Callable[[Settings, Config, Ledger], FrontendRuntime | None]


def _dra(settings: Settings, config: Config, ledger: Ledger) -> FrontendRuntime | None:
    if config.dra is None:
        return None
    # Only with the config's dra section: the Kubernetes client (lightkube,
    # httpx, anyio) is no part of a device plugin's memory.
    from dp_server.dra.wiring import DraRuntime

    return DraRuntime(settings, config, ledger)


#: dp's front ends, in the order they hear of every change.
FRONTENDS: tuple[Plug, ...] = (
    DevicePluginRuntime,
    _dra,
)
