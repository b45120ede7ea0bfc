"""deploy/monitoring/: the PodMonitor finds dp's pods and port, and every alert
asks for metrics, labels and label values that dp really exports."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from dp_core import Phase
from dp_core.deviceplugin.tally import OK, RPC_METHODS
from dp_server.monitoring.probes import runtime_families

from core_builders import live_node

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
MONITORING = DEPLOY / "monitoring"

# Labels whose values are a closed set, and that set.
CLOSED_VALUES = {
    "phase": {phase.value for phase in Phase},
    "health": {"healthy", "unhealthy", "reserved"},
    "state": {"in_flight", "failed"},
    "result": {"ok", "failed"},
    "method": set(RPC_METHODS.values()),
    "code": {OK, "INVALID_ARGUMENT", "FAILED_PRECONDITION", "UNAVAILABLE"},
}
SELECTOR = re.compile(r"\b(dp_[a-z_]+)(\{([^}]*)\})?")
MATCHER = re.compile(r'\s*([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"([^"]*)"\s*')


def load(name: str) -> dict[str, Any]:
    (document,) = [d for d in yaml.safe_load_all((MONITORING / name).read_text()) if d]
    assert isinstance(document, dict)
    return document


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """Every family dp exports -> its label names."""
    node, kubelet = live_node()
    runtime = SimpleNamespace(
        node=node,
        last_rescan=(0.0, 0.01),
        rescan_failures=0,
        now=lambda: 1.0,
        frontends=(),
        essential_tasks=lambda: {"timer-loop": ""},
    )
    return {
        family.name: {name for sample in family.samples for name, _ in sample.labels}
        for family in runtime_families(runtime)  # type: ignore[arg-type]
    }


def test_kustomization_lists_both_manifests_in_the_namespace() -> None:
    kustomization = load("kustomization.yaml")
    assert kustomization["namespace"] == "dp-system"
    assert sorted(kustomization["resources"]) == sorted(
        p.name for p in MONITORING.glob("*.yaml") if p.name != "kustomization.yaml"
    )


def test_pod_monitor_selects_dp_pods_and_their_metrics_port() -> None:
    monitor = load("podmonitor.yaml")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    (daemonset,) = [d for d in yaml.safe_load_all((DEPLOY / "daemonset.yaml").read_text()) if d]
    template = daemonset["spec"]["template"]
    labels = template["metadata"]["labels"]
    for key, value in monitor["spec"]["selector"]["matchLabels"].items():
        assert labels[key] == value
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (container,) = template["spec"]["containers"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
    address = container["args"][container["args"].index("--metrics-address") + 1]
    assert address == f":{ports[endpoint['port']]}"


def test_every_alert_asks_for_what_dp_exports(exported: dict[str, set[str]]) -> None:
    rule = load("prometheusrule.yaml")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    (group,) = rule["spec"]["groups"]
    alerts = [r["alert"] for r in group["rules"]]
    assert len(alerts) == len(set(alerts)) >= 6
    for entry in group["rules"]:
        assert entry["labels"]["severity"] in {"info", "warning", "critical"}, entry["alert"]
        assert entry["annotations"]["summary"], entry["alert"]
        if "for" in entry:
            assert re.fullmatch(r"\d+[smh]", entry["for"]), entry["alert"]
        selectors = SELECTOR.findall(entry["expr"])
        # Every alert is about a dp metric, except the one on Prometheus' own `up`.
        assert selectors or entry["expr"].startswith("up{"), f"{entry['alert']} names no dp metric"
        for metric, _, matchers in selectors:
            assert metric in exported, f"{entry['alert']}: dp exports no {metric}"
            for label, operator, value in MATCHER.findall(matchers):
                assert label in exported[metric], f"{entry['alert']}: {metric} has no {label}"
                if label in CLOSED_VALUES and operator in ("=", "!="):
                    assert value in CLOSED_VALUES[label], f"{entry['alert']}: {label}={value!r}"


def test_the_matcher_table_catches_a_misspelled_alert(exported: dict[str, set[str]]) -> None:
    # The check above must be able to fail: a label dp does not export is caught.
    (metric, _, matchers) = SELECTOR.findall('dp_resource_devices{helth="unhealthy"}')[0]
    labels = [label for label, _, _ in MATCHER.findall(matchers)]
    assert labels == ["helth"] and "helth" not in exported[metric]
