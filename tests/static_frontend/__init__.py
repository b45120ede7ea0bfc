"""A third front end, written as a plug-in author would: PCI devices held for
consumers outside Kubernetes (a VM a node runs by itself, say).

It proves the seam: a front end is its own package (`core`, the front end the
node drives; `wiring`, its `FrontendRuntime` in the server), plugged into a
real `Node` and a real `Runtime` beside dp's two without touching either.
"""

from .core import (
    ConsumerHanded,
    ConsumerHold,
    ConsumerRefused,
    ConsumerStarted,
    ConsumerStopped,
    StaticFrontend,
)
from .wiring import StaticRuntime, static_plug

__all__ = [
    "ConsumerHanded",
    "ConsumerHold",
    "ConsumerRefused",
    "ConsumerStarted",
    "ConsumerStopped",
    "StaticFrontend",
    "StaticRuntime",
    "static_plug",
]
