"""Stage timings and `pdserve generate --trace`, end to end: real router and worker processes on loopback
(1P1D and colocated) serving a tiny random model."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pdserve.cluster.cli import main
from pdserve.cluster.launch import local_deployment
from pdserve.cluster.local import LocalCluster
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

PROMPT = "济南的冬"
MAX_TOKENS = 6


@pytest.fixture(scope="module", params=["1p1d", "colocated"])
def cluster(request: pytest.FixtureRequest, tiny_llama_dir: Path) -> Iterator[LocalCluster]:
    topology = {"1p1d": dict(prefill=1, decode=1), "colocated": dict(prefill=0, decode=0, colocated=1)}
    config = local_deployment(model=str(tiny_llama_dir), threads_per_worker=1, metrics=True, **topology[request.param])  # type: ignore[arg-type]
    with LocalCluster(config) as started:
        yield started


def _generate(address: str, trace: bool) -> list[router_pb2.GenerateResponse]:
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(address))
    request = router_pb2.GenerateRequest(
        prompt=PROMPT, trace=trace, params=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    )
    return list(stub.Generate(request, timeout=120))


def test_stage_timings_present_and_within_e2e(cluster: LocalCluster) -> None:
    t = _generate(cluster.router_address, trace=False)[-1].timings
    assert t.tokenize_s > 0 and t.detokenize_s > 0 and t.decode_s > 0
    assert t.tokenize_s + t.queue_s + t.prefill_s + t.kv_transfer_s + t.decode_s <= t.e2e_s
    assert t.tokenize_s + t.detokenize_s <= t.e2e_s
    assert t.ttft_s <= t.e2e_s
    assert t.prefill_s > 0  # measured by the prefill worker, or by the colocated one
    if cluster.config.size("prefill"):
        assert t.kv_transfer_s > 0
    else:
        assert t.kv_transfer_s == 0


def test_untraced_stream_carries_no_trace(cluster: LocalCluster) -> None:
    responses = _generate(cluster.router_address, trace=False)
    assert not any(r.trace for r in responses)
    assert all(r.token_ids for r in responses)  # no trace-only messages either


def test_prometheus_has_tokenize_and_detokenize_histograms(cluster: LocalCluster) -> None:
    _generate(cluster.router_address, trace=False)
    name = next(n for n in cluster.metrics_addresses if n.startswith(("decode", "colocated")))
    with urllib.request.urlopen(f"http://{cluster.metrics_addresses[name]}/metrics", timeout=10) as page:
        text = page.read().decode()
    for metric in ("pdserve_tokenize_seconds_count", "pdserve_detokenize_seconds_count"):
        count = re.search(rf"^{metric} (\S+)$", text, re.M)
        assert count is not None and float(count.group(1)) >= 1, metric


def test_cli_request_id_reaches_router_and_workers(cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
    """`pdserve generate --request-id`: the response echoes it (--json), and the traced request's events
    come from the workers that served that id; a bad id is refused by the router's validation."""
    request_id = f"cli-{cluster.config.size('prefill')}p-req/7"
    argv = ["generate", "--url", cluster.router_address, "--json", "--trace", "--max-tokens", "2", "--ignore-eos"]
    assert main([*argv, "--request-id", request_id, PROMPT]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["request_id"] == request_id and len(doc["token_ids"]) == 2 and doc["trace"]
    worker = "decode-0" if cluster.config.size("decode") else "colocated-0"
    for name, logged in (
        ("router", f"Generate start request_id={request_id} internal_id="),
        (worker, f"client_request_id={request_id}"),
    ):  # the worker keys on the internal id
        assert logged in (cluster.log_dir / f"{name}.log").read_text(), name
    assert main([*argv, PROMPT]) == 0  # no --request-id: the router makes one
    made = json.loads(capsys.readouterr().out)["request_id"]
    assert made and made != request_id
    assert main([*argv, "--request-id", "bad\u00e9id", PROMPT]) == 1
    assert "INVALID_ARGUMENT: request_id: must be printable ASCII" in capsys.readouterr().err


def test_cli_trace_one_prefill_pass_then_one_decode_step_per_token(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--url", cluster.router_address, "--trace", "--max-tokens", str(MAX_TOKENS), "--ignore-eos"]
    assert main([*argv, PROMPT]) == 0
    lines = capsys.readouterr().out.splitlines()
    stages = [_stage(line) for line in lines[:-1]]
    assert lines[-1].startswith("text: ")
    assert stages[0] == "route"  # the router's placement comes first
    if cluster.config.size("prefill"):
        assert re.search(r"disaggregated: decode 127\.0\.0\.1:\d+, prefill 127\.0\.0\.1:\d+$", lines[0]), lines[0]
    else:
        assert re.search(r"colocated: decode 127\.0\.0\.1:\d+$", lines[0]), lines[0]
    tokenized = re.search(r" (\d+) tokens: ", lines[1])
    assert stages[1] == "tokenize" and tokenized is not None
    num_prompt = int(tokenized.group(1))
    assert "<e6 b5> <8e>" in lines[1]  # 济 is split over two byte-level tokens
    prefills = [line for line, stage in zip(lines[:-1], stages, strict=True) if stage == "prefill"]
    assert len(prefills) == 1
    assert f"pass over {num_prompt} prompt tokens, KV 0 -> {num_prompt}, first token" in prefills[0]
    decodes = [line for line, stage in zip(lines[:-1], stages, strict=True) if stage == "decode"]
    assert [int(re.search(r", KV (\d+),", d).group(1)) for d in decodes] == list(
        range(num_prompt + 1, num_prompt + MAX_TOKENS)
    )  # one step per further token
    handoffs = [line for line, stage in zip(lines[:-1], stages, strict=True) if stage == "kv hand-off"]
    if cluster.config.size("prefill"):
        assert "prefill-0" in prefills[0] and all("decode-0" in d for d in decodes)
        assert len(handoffs) == 1 and re.search(r"(shm|grpc), [\d,]+ bytes", handoffs[0])
        assert stages.index("prefill") < stages.index("kv hand-off") < stages.index("decode")
    else:
        assert handoffs == [] and "colocated-0" in prefills[0]
    assert stages[-1] == "finish" and f"{MAX_TOKENS} generated tokens" in lines[-2]
    assert set(stages) <= {"route", "tokenize", "prefill", "kv hand-off", "decode", "detok hold", "finish"}


def test_cli_json_trace_lists_the_events(cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--url", cluster.router_address, "--json", "--trace", "--max-tokens", "3", "--ignore-eos"]
    assert main([*argv, PROMPT]) == 0
    doc = json.loads(capsys.readouterr().out)
    kinds = [
        next(k for k in ("route", "tokenize", "prefill", "kv_transfer", "decode", "hold") if k in e)
        for e in doc["trace"]
    ]
    assert kinds[:3] == ["route", "tokenize", "prefill"] and kinds.count("decode") == 2
    assert doc["trace"][0]["route"]["decision"] == ("disaggregated" if cluster.config.size("prefill") else "colocated")
    assert len(doc["token_ids"]) == 3 and doc["timings"]["tokenize_s"] > 0


def _stage(line: str) -> str:
    """The stage column of a trace line ("   12.3 ms  decode      decode-0   ...")."""
    match = re.match(r"\s*[\d.]+ ms  (kv hand-off|detok hold|\S+)", line)
    assert match is not None, line
    return match.group(1)
