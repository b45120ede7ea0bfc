"""What the shell needs to know of the front end's state between inputs,
sent as an effect each time it changes, so that the shell never reads the
front end itself (the seam runs one way).

Two states: whether the registrations have settled (`RegistrationsSettled`:
the shell collects what the connections a storm of Registers dropped left
behind), and whether the kubelet's checkpoint is wanted
(`KubeletCheckpointWanted`: the shell reads it again at each write only
then). The front end compares after every input (`DevicePluginFrontend.due`),
so a change is sent once, among the effects of the input that made it.
"""

from __future__ import annotations

from .effects import KubeletCheckpointWanted, RegistrationsSettled

__all__ = ["Notice", "Notices"]

Notice = RegistrationsSettled | KubeletCheckpointWanted


class Notices:
    """The states as last sent."""

    def __init__(self) -> None:
        # As a shell that has been sent nothing takes them: no resource yet,
        # so none unregistered, and no checkpoint wanted.
        self._settled = True
        self._checkpoint_wanted = False

    def changed(self, *, settled: bool, checkpoint_wanted: bool) -> list[Notice]:
        """The notices for what changed since the last call, and nothing else.

        Only settling is sent, not unsettling: the shell acts on the end of
        a storm of Registers, whose start it sees in the Registers."""
        notices: list[Notice] = []
        if settled and not self._settled:
            notices.append(RegistrationsSettled())
        self._settled = settled
        if checkpoint_wanted != self._checkpoint_wanted:
            notices.append(KubeletCheckpointWanted(checkpoint_wanted))
        self._checkpoint_wanted = checkpoint_wanted
        return notices
