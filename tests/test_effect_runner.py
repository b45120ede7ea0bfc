"""The EffectRunner carries out every kind of effect the core can emit."""

from __future__ import annotations

import typing
from pathlib import Path

from dp_core import Effect
from dp_server.binding.moves_file import MovesStore
from dp_server.deviceplugin.pod_resources import PodResourcesPoller
from dp_server.deviceplugin.streams import Streams
from dp_server.runtime.effects import EffectRunner


def test_every_effect_of_the_core_has_a_handler(tmp_path: Path) -> None:
    runner = EffectRunner(
        streams=Streams(),
        registers=None,  # type: ignore[arg-type]  # not called by handles()
        pods=PodResourcesPoller(str(tmp_path / "pr.sock"), 10.0, 1.0),
        binds=None,  # type: ignore[arg-type]
        moves=MovesStore(None),
        cdi=None,
        feed=lambda event: None,
        spawn=lambda coroutine: None,
        now=lambda: 0.0,
        stopping=lambda: False,
    )
    kinds = typing.get_args(Effect)
    assert len(kinds) >= 18
    assert [kind.__name__ for kind in kinds if not runner.handles(kind)] == []
