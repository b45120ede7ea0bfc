"""What the DRA front end's wiring reports to monitoring, besides the API
client's requests and the slice publisher's and the Events' own families."""

from __future__ import annotations

from collections.abc import Iterator

from dp_core import MetricFamily, Sample

__all__ = ["wiring_families"]


def wiring_families(
    driver: str,
    *,
    registered: bool,
    health_streams: int,
    file_failures: int,
    checkpoint_failures: int,
) -> Iterator[MetricFamily]:
    yield MetricFamily(
        "gauge",
        "dp_dra_registered",
        "1 while the kubelet says it registered the DRA driver on our socket, else 0.",
        (Sample((("driver", driver),), 1 if registered else 0),),
    )
    yield MetricFamily(
        "gauge",
        "dp_dra_health_streams",
        "Health streams (NodeWatchResources) the kubelet holds open on the DRA socket.",
        (Sample((), health_streams),),
    )
    yield MetricFamily(
        "counter",
        "dp_dra_claim_file_failures_total",
        "Claims whose CDI spec or metadata files could not be written or removed.",
        (Sample((), file_failures),),
    )
    yield MetricFamily(
        "counter",
        "dp_dra_checkpoint_failures_total",
        "Writes of the prepared claims' checkpoint (claims.json) that failed.",
        (Sample((), checkpoint_failures),),
    )
