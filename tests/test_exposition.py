"""dp's families through prometheus-client's registry and text format, read back
by prometheus-client's own parser; and the metrics-address syntax."""

from __future__ import annotations

import importlib.metadata
import math
import time
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import DuplicateTimeseries

from dp_core import MetricFamily, Sample, collect
from dp_server.cli.main import parse_address
from dp_server.monitoring.exposition import FamiliesCollector, metrics_registry
from dp_server.monitoring.probes import runtime_families

from core_builders import GPU_RESOURCE, live_node

Parsed = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parsed(text: bytes) -> Parsed:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            out[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return out


def exposed(*families: MetricFamily) -> bytes:
    """What a registry holding only a FamiliesCollector of `families` renders."""
    registry = CollectorRegistry()
    registry.register(FamiliesCollector(lambda: families))
    return generate_latest(registry)


def test_labels_help_and_values_survive_the_round_trip() -> None:
    awkward = 'a "quoted" back\\slash\nnewline'
    text = exposed(
        MetricFamily(
            "gauge",
            "dp_test_gauge",
            "Help with a back\\slash\nand a newline.",
            (
                Sample((("name", awkward), ("zone", "")), 1.5),
                Sample((("name", "plain"), ("zone", "z")), 3),
                Sample((("name", "inf"), ("zone", "z")), math.inf),
            ),
        ),
        MetricFamily("counter", "dp_test_total", "A counter.", (Sample((), 7),)),
        MetricFamily("gauge", "dp_test_empty", "No samples yet.", ()),
    )
    got = parsed(text)
    assert got["dp_test_gauge", (("name", awkward), ("zone", ""))] == 1.5
    assert got["dp_test_gauge", (("name", "plain"), ("zone", "z"))] == 3
    assert got["dp_test_gauge", (("name", "inf"), ("zone", "z"))] == math.inf
    assert got["dp_test_total", ()] == 7
    kinds = {f.name: f.type for f in text_string_to_metric_families(text.decode())}
    assert kinds == {"dp_test_gauge": "gauge", "dp_test": "counter", "dp_test_empty": "gauge"}
    helps = {f.name: f.documentation for f in text_string_to_metric_families(text.decode())}
    assert helps["dp_test_gauge"] == "Help with a back\\slash\nand a newline."
    # A counter keeps the exposed name dp_core gave it: one _total, not two.
    assert b"# TYPE dp_test_total counter\n" in text and b"dp_test_total 7" in text
    assert b"_total_total" not in text
    # A family without samples still says what it is.
    assert b"# TYPE dp_test_empty gauge\n" in text


def test_nan_reads_back_as_nan() -> None:
    text = exposed(MetricFamily("gauge", "dp_test_nan", "x", (Sample((), math.nan),)))
    assert math.isnan(parsed(text)["dp_test_nan", ()])


def test_the_collector_reads_its_families_at_every_scrape() -> None:
    value = [1]
    registry = CollectorRegistry()
    registry.register(
        FamiliesCollector(
            lambda: [MetricFamily("gauge", "dp_test_now", "x", (Sample((), value[0]),))]
        )
    )
    assert parsed(generate_latest(registry))["dp_test_now", ()] == 1
    value[0] = 2
    assert parsed(generate_latest(registry))["dp_test_now", ()] == 2


def test_every_core_family_appears_with_its_type_help_and_samples() -> None:
    node, kubelet = live_node()
    kubelet.allocate(GPU_RESOURCE, ("0000:3b:00.0",))
    families = collect(node)
    text = exposed(*families)
    read = {f.name: f for f in text_string_to_metric_families(text.decode())}
    got = parsed(text)
    for family in families:
        # The parser names a counter without its _total, as Prometheus does.
        name = family.name.removesuffix("_total") if family.kind == "counter" else family.name
        assert read[name].type == family.kind, family.name
        assert read[name].documentation == family.help, family.name
        for sample in family.samples:
            assert got[family.name, tuple(sorted(sample.labels))] == sample.value, family.name
        assert len(read[name].samples) == len(family.samples), family.name
    key = (("code", "OK"), ("method", "Allocate"), ("resource", GPU_RESOURCE))
    assert got["dp_rpcs_total", key] == 1


def test_a_whole_node_and_this_process_parse() -> None:
    node, kubelet = live_node()
    kubelet.allocate(GPU_RESOURCE, ("0000:3b:00.0",))
    view = SimpleNamespace(
        node=node,
        last_rescan=(0.0, 0.01),
        rescan_failures=0,
        now=lambda: 1.0,
        frontends=(),
        essential_tasks=lambda: {"timer-loop": ""},
    )
    text = generate_latest(metrics_registry(lambda: runtime_families(view)))  # type: ignore[arg-type]
    got = parsed(text)
    key = (("code", "OK"), ("method", "Allocate"), ("resource", GPU_RESOURCE))
    assert got["dp_rpcs_total", key] == 1
    assert got["dp_host_scan_duration_seconds", ()] == 0.01
    assert got["dp_task_running", (("task", "timer-loop"),)] == 1
    # The process metrics come from prometheus-client's ProcessCollector.
    assert got["process_resident_memory_bytes", ()] > 1_000_000
    assert got["process_virtual_memory_bytes", ()] > 0
    assert got["process_open_fds", ()] >= 3
    assert got["process_max_fds", ()] >= got["process_open_fds", ()]
    assert got["process_cpu_seconds_total", ()] > 0
    assert 0 < got["process_start_time_seconds", ()] <= time.time()
    # ...and python_info from its PlatformCollector.
    assert [v for (name, _), v in got.items() if name == "python_info"] == [1]
    assert [v for (name, _), v in got.items() if name == "dp_build_info"] == [1]
    (version,) = [dict(k)["version"] for (name, k) in got if name == "dp_build_info"]
    assert version == importlib.metadata.version("dp")


def test_two_collectors_exposing_one_name_fail_when_the_registry_is_built() -> None:
    with pytest.raises(DuplicateTimeseries, match="process_open_fds"):
        metrics_registry(
            lambda: [MetricFamily("gauge", "process_open_fds", "Clashes.", (Sample((), 1),))]
        )


@pytest.mark.parametrize(
    ("text", "address"),
    [
        (":9475", (None, 9475)),
        ("127.0.0.1:9475", ("127.0.0.1", 9475)),
        ("[::1]:80", ("::1", 80)),
        ("localhost:0", ("localhost", 0)),
    ],
)
def test_metrics_addresses(text: str, address: tuple[str, int]) -> None:
    assert parse_address(text) == address


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("9475", "is not HOST:PORT"),
        ("host:http", "is not HOST:PORT"),
        (":70000", "is not HOST:PORT"),
        ("::1:80", "in brackets"),
    ],
)
def test_bad_metrics_addresses_are_named(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_address(text)
