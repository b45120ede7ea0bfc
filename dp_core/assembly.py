"""dp's own node: a `Node` with its two front ends on one ledger.

`Node` knows no front end; this is where dp's are put together, in the
order they hear of every change: the kubelet's device-plugin API, then DRA.
A plugin author with a front end of their own makes a `Node` with it (and
these two, if wanted) instead; docs/core.md shows how.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

from .config.config import Config
from .deviceplugin.endpoints import NAME_MAX
from .deviceplugin.frontend import DevicePluginFrontend
from .deviceplugin.registration import SocketMode
from .dra.frontend import DraFrontend
from .effects import Effect
from .frontend import Frontend
from .host.pci import PciId
from .ledger import Ledger
from .node import Node
from .timing import Timing

__all__ = ["StandardNode"]

M = TypeVar("M")  # the effects of the `more` front ends


class StandardNode(Node[Effect | M]):
    """A node with the device-plugin front end (`device_plugin`) and the DRA
    front end (`dra`), and any `more` after them, made with the node's ledger."""

    def __init__(
        self,
        config: Config,
        *,
        socket_mode: SocketMode = SocketMode.SINGLE,
        endpoint_prefix: str = "dp",
        endpoint_max_length: int = NAME_MAX,
        timing: Timing | None = None,
        pci_names: Mapping[PciId, str] | None = None,
        cdi: bool = False,
        node_name: str | None = None,
        dra_partitionable: bool = True,
        dra_device_taints: bool = True,
        ledger: Ledger | None = None,
        more: Sequence[Frontend[M]] = (),
    ) -> None:
        timing = timing or Timing()
        ledger = ledger if ledger is not None else Ledger()
        self.timing = timing
        self.device_plugin = DevicePluginFrontend(
            ledger,
            timing,
            socket_mode=socket_mode,
            endpoint_prefix=endpoint_prefix,
            endpoint_max_length=endpoint_max_length,
            cdi=cdi,
        )
        # The dra_* flags are what the config's "auto" assumes until the API
        # server shows whether it has those features (DraFeaturesObserved).
        self.dra = DraFrontend(
            ledger,
            node_name or "",
            partitionable=dra_partitionable,
            device_taints=dra_device_taints,
            health_resend=timing.health_resend,
        )
        super().__init__(
            config, (self.device_plugin, self.dra, *more), ledger=ledger, pci_names=pci_names
        )
