"""The /metrics endpoint's ports: 0 starts nothing, METRICS_ANY_PORT binds a free port of the system's
choosing and reports it (what the local launcher asks of every process, so that no port picked in the
launcher can be taken before a worker binds it), and two such endpoints never collide."""

from __future__ import annotations

import urllib.request

from prometheus_client import CollectorRegistry, Counter

from pdserve.constants import METRICS_ANY_PORT
from pdserve.telemetry.prometheus import start_metrics_endpoint


def test_port_zero_starts_nothing() -> None:
    assert start_metrics_endpoint(CollectorRegistry(), 0) is None
    assert start_metrics_endpoint(CollectorRegistry(), None) is None


def test_any_port_binds_a_free_port_and_serves_the_registry() -> None:
    registries = [CollectorRegistry(), CollectorRegistry()]
    for number, registry in enumerate(registries):
        Counter(f"probe_{number}", "a probe", registry=registry).inc(number + 1)
    endpoints = [start_metrics_endpoint(registry, METRICS_ANY_PORT) for registry in registries]
    try:
        assert all(e is not None and e.port > 0 for e in endpoints)
        assert endpoints[0].port != endpoints[1].port  # type: ignore[union-attr]
        for number, endpoint in enumerate(endpoints):
            text = urllib.request.urlopen(endpoint.url, timeout=10).read().decode()  # type: ignore[union-attr]
            assert f"probe_{number}_total {float(number + 1)}" in text
    finally:
        for endpoint in endpoints:
            if endpoint is not None:
                endpoint.stop()
