"""How long a node waits, and how it spaces attempts that fail.

`Backoff` is the one exponential backoff of dp: the core's registrations use
it as it is; the shell's API sessions and slice repairs pass in a random
`jitter` of their own, since the core has no randomness.
"""

from __future__ import annotations

import attrs

__all__ = ["Backoff", "Timing"]


@attrs.frozen
class Backoff:
    """Exponential delay between attempts: 0, first, 2*first, ... up to `cap`."""

    # Short, because the commonest failure is brief: the kubelet's net.Listen
    # creates kubelet.sock (which the watcher reports) before it listens, and a
    # Register in between is refused; a 100 ms first delay was seen to hold
    # back part of a restart's re-registration by that much.
    first: float = 0.02
    cap: float = 5.0
    # A connection that lived this long proves the last attempt worked.
    healthy_after: float = 10.0

    def delay(self, failures: int, jitter: float = 1.0) -> float:
        """The wait after `failures` in a row, scaled by `jitter` (the shell's
        random 0.5-1, so that many nodes do not retry in step)."""
        if failures <= 0:
            return 0.0
        return float(min(self.cap, self.first * 2 ** (failures - 1))) * jitter


@attrs.frozen
class Timing:
    """How long the node waits for things; all in seconds."""

    dial_wait: float = 3.0
    # After a reply without a dial from a kubelet that dials inside Register.
    held_client_wait: float = 0.2
    # After a Register timed out undialled: the shared socket waits this long
    # for the kubelet's late dial, which is then refused.
    late_dial_wait: float = 10.0
    backoff: Backoff = Backoff()
    # An allocation younger than this is not released on a PodResources
    # answer that leaves it out. The kubelet records a pod's devices (which
    # `List` then shows as long as the pod is active) right after the plugin's
    # Allocate answer; only an answer to a `List` asked before that can leave
    # them out. An answer comes at most the call's 5 s deadline after it was
    # asked (dp_server.deviceplugin.pod_resources.LIST_TIMEOUT), so one that
    # comes 7 s after the Allocate was asked 2 s after it at the earliest.
    release_grace: float = 7.0
    # While a kubelet that has just started syncs its pods, PodResources is
    # asked this often (kubelet_sync), and `sync_poll_slow` once the kubelet
    # has been syncing for `sync_poll_fast_for` (an API server out of reach
    # keeps it syncing; its own rate limit is 100 a second).
    sync_poll: float = 0.2
    sync_poll_slow: float = 2.0
    sync_poll_fast_for: float = 30.0
    # How often an open DRA health stream is sent its list when nothing changed
    # (dra_health_watch): the kubelet reads a device not heard of for
    # longer than its timeout (three times this, and a second) as Unknown.
    health_resend: float = attrs.field(default=10.0)

    @health_resend.validator
    def _positive(self, attribute: attrs.Attribute[float], value: float) -> None:
        if not value > 0:
            raise ValueError(f"health_resend must be positive seconds, not {value!r}")
