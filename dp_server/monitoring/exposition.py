"""dp's metric families in a prometheus-client registry, and the text it renders.

`FamiliesCollector` turns the `dp_core.MetricFamily` values a callable returns
into prometheus-client metric families at every scrape; `metrics_registry`
puts one in a private `CollectorRegistry` beside prometheus-client's own
`ProcessCollector` (the `process_*` metrics) and `PlatformCollector`
(`python_info`). `render` is prometheus-client's `generate_latest`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest

from dp_core import MetricFamily

try:
    from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4 as _CONTENT_TYPE
except ImportError:  # older releases: CONTENT_TYPE_LATEST is still 0.0.4
    from prometheus_client.exposition import CONTENT_TYPE_LATEST as _CONTENT_TYPE

__all__ = ["CONTENT_TYPE", "FamiliesCollector", "metrics_registry", "render", "to_prometheus"]

# What `generate_latest` writes: the 0.0.4 text format. Newer prometheus-client
# releases name 1.0.0 as CONTENT_TYPE_LATEST, which they serve only to a scraper
# that asks for it; a plain GET gets 0.0.4 from their own handlers, as from dp.
CONTENT_TYPE: str = _CONTENT_TYPE


def to_prometheus(family: MetricFamily) -> Metric:
    """`family` as a prometheus-client family, with the same exposed name."""
    metric: Metric
    if family.kind == "counter":
        # prometheus-client names a counter without its `_total` (dp_core
        # requires one) and exposes it with it: dp_rpcs_total stays dp_rpcs_total.
        metric = CounterMetricFamily(family.name.removesuffix("_total"), family.help)
    else:
        metric = GaugeMetricFamily(family.name, family.help)
    for sample in family.samples:
        metric.add_sample(family.name, dict(sample.labels), sample.value)
    return metric


class FamiliesCollector:
    """A prometheus-client collector of the dp families `families()` returns at each scrape."""

    def __init__(self, families: Callable[[], Iterable[MetricFamily]]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        for family in self._families():
            yield to_prometheus(family)


def metrics_registry(families: Callable[[], Iterable[MetricFamily]]) -> CollectorRegistry:
    """A registry of its own: dp's families, then `process_*`, then `python_info`.

    With auto_describe each collector is collected once here, so two of them
    exposing the same name fail now rather than at a scrape.
    """
    registry = CollectorRegistry(auto_describe=True)
    registry.register(FamiliesCollector(families))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The text exposition of everything `registry` collects now."""
    return generate_latest(registry)
