"""The hand-written text exposition, read back by prometheus-client's own parser."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dp_core import MetricFamily, Sample, collect
from dp_server.cli import parse_address
from dp_server.exposition import render
from dp_server.status import build_info, process_families

from core_builders import GPU_RESOURCE, live_node


def parsed(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            out[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_labels_help_and_values_survive_the_round_trip() -> None:
    awkward = 'a "quoted" back\\slash\nnewline'
    families = [
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
    ]
    text = render(families)
    got = parsed(text)
    assert got["dp_test_gauge", (("name", awkward), ("zone", ""))] == 1.5
    assert got["dp_test_gauge", (("name", "plain"), ("zone", "z"))] == 3
    assert got["dp_test_gauge", (("name", "inf"), ("zone", "z"))] == math.inf
    assert got["dp_test_total", ()] == 7
    kinds = {f.name: f.type for f in text_string_to_metric_families(text.decode())}
    assert kinds == {"dp_test_gauge": "gauge", "dp_test": "counter", "dp_test_empty": "gauge"}
    helps = {f.name: f.documentation for f in text_string_to_metric_families(text.decode())}
    assert helps["dp_test_gauge"] == "Help with a back\\slash\nand a newline."
    assert b"dp_test_gauge{" in text and text.endswith(b"\n")
    # Integral values print as integers, so a device count reads as one.
    assert b'dp_test_gauge{name="plain",zone="z"} 3\n' in text


def test_nan_is_written_as_prometheus_spells_it() -> None:
    text = render([MetricFamily("gauge", "dp_test_nan", "x", (Sample((), math.nan),))])
    assert b"dp_test_nan NaN\n" in text
    assert math.isnan(parsed(text)["dp_test_nan", ()])


def test_a_whole_node_and_this_process_parse() -> None:
    node, kubelet = live_node()
    kubelet.allocate(GPU_RESOURCE, ("0000:3b:00.0",))
    got = parsed(render([*collect(node), *process_families(), build_info()]))
    key = (("code", "OK"), ("method", "Allocate"), ("resource", GPU_RESOURCE))
    assert got["dp_rpcs_total", key] == 1
    assert got["process_resident_memory_bytes", ()] > 1_000_000
    assert got["process_open_fds", ()] >= 3
    assert got["process_cpu_seconds_total", ()] > 0
    assert [v for (name, _), v in got.items() if name == "dp_build_info"] == [1]


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
