"""A plug-in front end as `mypy --strict` sees it beside dp's two (`.ci/run`
checks this module): its own inputs go to `Node.handle`, and its own effects
come back among the node's, typed."""

from __future__ import annotations

from typing import assert_type

from dp_core import Config, Effect, Ledger, NodeEffect, StandardNode

from .core import ConsumerHanded, ConsumerStarted, StaticFrontend
from .core import Effect as StaticEffect


def handed(consumers: dict[str, list[str]], consumer: str) -> list[ConsumerHanded]:
    """What a `StandardNode` with the static front end hands `consumer` when it starts."""
    ledger = Ledger()
    static = StaticFrontend(ledger, consumers)
    node = StandardNode(Config(shared_devices=()), ledger=ledger, more=(static,))
    assert_type(node, StandardNode[StaticEffect])
    # A list is invariant: these are the node's own, dp's and the static front end's.
    effects: list[NodeEffect | Effect | StaticEffect] = node.handle(ConsumerStarted(consumer, 1.0))
    return [effect for effect in effects if isinstance(effect, ConsumerHanded)]
