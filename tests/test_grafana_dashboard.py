"""The Grafana dashboard (docs/grafana/pdserve.json): every PromQL query names only metrics that the
router's and the workers' registries export, with labels those metrics carry, and the dashboard covers
what an operator watches (TTFT/ITL/E2E, KV transfer bytes and seconds by backend, queues, pool usage,
failovers)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from pdserve.engine.metrics import WorkerMetrics
from pdserve.router.prom_metrics import RouterPrometheus

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "docs" / "grafana" / "pdserve.json"
METRIC_DEFINITION = re.compile(r"\b(?:Counter|Gauge|Histogram|Summary|Info|Enum)\(\s*\"(pdserve_\w+)\"")
# labels Prometheus itself attaches to every scraped series, and histograms' bucket label
SCRAPE_LABELS = {"job", "instance", "le"}


def _exported(registry: CollectorRegistry) -> dict[str, set[str]]:
    """Sample name -> label names, as /metrics exposes them."""
    out: dict[str, set[str]] = {}
    for family in registry.collect():
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    router, worker = RouterPrometheus(), WorkerMetrics()
    # labelled series appear once a child exists: make one of each, as serving does
    router.requests.labels("FINISH_REASON_STOP").inc()
    worker.kv_transferred("grpc", "send", 1024, 0.01)
    worker.kv_failed("grpc", "send")
    worker.bind_gauges(lambda: 0, lambda: 0, lambda: 0, lambda: 1)
    from pdserve.cluster.autoscaler import AutoscalerMetrics

    autoscaler = AutoscalerMetrics()  # the autoscaler's own registry (serve --autoscale)
    autoscaler.decisions.labels("switch", "prefill", "done").inc()
    autoscaler.workers.labels("prefill").set(1)
    autoscaler.observe({"prefill": 1, "decode": 1, "ttft_attainment": 1.0, "tpot_attainment": 1.0})
    router.role_switches.labels("decode", "prefill").inc()
    router.worker_waits.labels("decode").inc()
    router.worker_wait_time.labels("served").observe(1.0)
    router.route_decisions.labels("disaggregated").inc()
    names = _exported(router.registry)
    for name, labels in [*_exported(worker.registry).items(), *_exported(autoscaler.registry).items()]:
        names.setdefault(name, set()).update(labels)
    return names


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(panels: list[dict]) -> list[dict]:
    out = []
    for panel in panels:
        out.append(panel)
        out.extend(_panels(panel.get("panels", [])))
    return out


def _queries(dashboard: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in _panels(dashboard["panels"]) for t in p.get("targets", [])]


def _labels_used(expr: str) -> set[str]:
    labels: set[str] = set()
    for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        labels.update(x.strip() for x in group.split(",") if x.strip())
    for selector in re.findall(r"\{([^}]*)\}", expr):
        labels.update(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", selector))
    return labels


def test_every_metric_defined_in_the_code_is_in_the_registries(exported: dict[str, set[str]]) -> None:
    """Guards the fixture: a metric defined elsewhere than the two registries would be missed."""
    defined = set()
    for path in REPO.rglob("*.py"):
        if any(part in {".venv", "tests", "build"} or part.startswith(".") for part in path.relative_to(REPO).parts):
            continue
        defined.update(METRIC_DEFINITION.findall(path.read_text(encoding="utf-8")))
    assert defined, "no metric definitions found"
    missing = [name for name in sorted(defined) if not any(s == name or s.startswith(name + "_") for s in exported)]
    assert not missing, f"metrics defined in the code but in no registry: {missing}"


def test_every_query_names_exported_metrics_and_their_labels(dashboard: dict, exported: dict[str, set[str]]) -> None:
    queries = _queries(dashboard)
    assert len(queries) >= 15
    for title, expr in queries:
        names = set(re.findall(r"\bpdserve_\w+", expr))
        assert names, f"{title}: query names no pdserve metric: {expr}"
        unknown = names - set(exported)
        assert not unknown, f"{title}: {sorted(unknown)} not exported (exported: {sorted(exported)})"
        allowed = SCRAPE_LABELS.union(*(exported[n] for n in names))
        assert _labels_used(expr) <= allowed, f"{title}: labels {_labels_used(expr) - allowed} not on {names}"
        assert expr.count("(") == expr.count(")"), f"{title}: unbalanced parentheses: {expr}"


def test_dashboard_covers_the_serving_signals(dashboard: dict) -> None:
    text = " ".join(expr for _, expr in _queries(dashboard))
    for needed in (
        "pdserve_time_to_first_token_seconds_bucket",
        "pdserve_inter_token_latency_seconds_bucket",
        "pdserve_e2e_request_latency_seconds_bucket",
        "pdserve_kv_transfer_bytes_total",
        "pdserve_kv_transfer_seconds_bucket",
        "pdserve_num_requests_waiting",
        "pdserve_request_queue_time_seconds_bucket",
        "pdserve_kv_blocks_used",
        "pdserve_kv_blocks_total",
        "pdserve_failovers_total",
    ):
        assert needed in text, needed
    for needed in (
        "pdserve_autoscaler_workers",
        "pdserve_autoscaler_decisions_total",
        "pdserve_role_switches_total",
        "pdserve_autoscaler_slo_attainment",
    ):  # serve --autoscale: roles and decisions
        assert needed in text, needed
    kv = [expr for _, expr in _queries(dashboard) if "pdserve_kv_transfer_" in expr]
    assert kv and all("backend" in expr for expr in kv), "KV transfer panels must split by backend"


def test_dashboard_is_importable_grafana_json(dashboard: dict) -> None:
    panels = _panels(dashboard["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "router_job", "worker_job", "autoscaler_job"} <= variables
    for panel in panels:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]) and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"]
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs))
        for used in re.findall(r"\$(\w+)", json.dumps(panel.get("targets", []))):
            assert used in variables or used.startswith("__"), f"{panel['title']}: unknown variable ${used}"
