"""A real router against in-process fake workers: relay, timings, spreading, errors, cancellation,
status, reflection, and the no-torch import rule."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from router_fakes import SCRIPT, FakeDecode, FakePrefill
from waiting import eventually

from pdserve.router.config import RouterConfig
from pdserve.v1 import common_pb2, router_pb2

REPO = Path(__file__).resolve().parents[2]
REQUEST = router_pb2.GenerateRequest(prompt="Hello", params=common_pb2.SamplingParams(max_tokens=3))


def _pd(fake_server, start_router, *decodes: FakeDecode, decode_policy: str = "round_robin"):
    prefill = fake_server(FakePrefill())
    addresses = tuple(fake_server(d) for d in decodes)
    config = RouterConfig(prefill=(prefill,), decode=addresses, decode_policy=decode_policy)
    server, stub = start_router(config)
    return server, stub, prefill, addresses


def test_relays_stream_in_order_with_router_timings(fake_server, start_router) -> None:
    decode = FakeDecode()
    _, stub, prefill, _ = _pd(fake_server, start_router, decode)
    responses = list(stub.Generate(REQUEST, timeout=10))
    assert [r.text for r in responses] == [r.text for r in SCRIPT]
    assert [list(r.token_ids) for r in responses] == [[10], [11], [12]]
    last = responses[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_STOP and last.usage.completion_tokens == 3
    assert 0 < last.timings.ttft_s <= last.timings.e2e_s
    assert last.timings.prefill_s == 0.01  # worker timings are kept
    assert all(r.request_id == decode.requests[0].request_id for r in responses)
    assert len(decode.requests[0].request_id) == 32  # uuid4 hex
    assert decode.requests[0].prefill_address == prefill
    assert decode.requests[0].prompt == "Hello" and decode.requests[0].params.max_tokens == 3


def test_client_request_id_is_kept(fake_server, start_router) -> None:
    decode = FakeDecode()
    _, stub, _, _ = _pd(fake_server, start_router, decode)
    request = router_pb2.GenerateRequest(request_id="abc-1", token_ids=common_pb2.TokenIds(ids=[1, 2]))
    responses = list(stub.Generate(request, timeout=10))
    assert {r.request_id for r in responses} == {"abc-1"}
    assert list(decode.requests[0].token_ids.ids) == [1, 2]


def test_round_robin_spreads_across_decode_workers(fake_server, start_router) -> None:
    decodes = [FakeDecode(), FakeDecode()]
    _, stub, _, _ = _pd(fake_server, start_router, *decodes)
    for _ in range(4):
        list(stub.Generate(REQUEST, timeout=10))
    assert [len(d.requests) for d in decodes] == [2, 2]


def test_least_loaded_spreads_a_concurrent_burst(fake_server, start_router) -> None:
    decodes = [FakeDecode(mode="hang"), FakeDecode(mode="hang")]
    _, stub, _, _ = _pd(fake_server, start_router, *decodes, decode_policy="least_loaded")
    calls = [stub.Generate(REQUEST, timeout=10) for _ in range(6)]
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(next, calls))  # every request reached a worker
    assert sorted(len(d.requests) for d in decodes) == [3, 3]
    for call in calls:
        call.cancel()


def test_colocated_worker_gets_empty_prefill_address(fake_server, start_router) -> None:
    colocated = FakeDecode(role=common_pb2.WORKER_ROLE_COLOCATED)
    _, stub = start_router(RouterConfig(colocated=(fake_server(colocated),)))
    list(stub.Generate(REQUEST, timeout=10))
    assert colocated.requests[0].prefill_address == ""


def test_decode_error_code_and_details_pass_through(fake_server, start_router) -> None:
    _, stub, _, _ = _pd(fake_server, start_router, FakeDecode(mode="exhausted"))
    try:
        list(stub.Generate(REQUEST, timeout=10))
        raise AssertionError("expected an error")
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error.details() == "kv cache full: need 9 blocks, 0 free"


def test_unreachable_decode_worker_gives_unavailable_quickly(fake_server, start_router) -> None:
    prefill = fake_server(FakePrefill())
    _, stub = start_router(RouterConfig(prefill=(prefill,), decode=("127.0.0.1:1",)))
    started = time.monotonic()
    try:
        list(stub.Generate(REQUEST, timeout=10))
        raise AssertionError("expected an error")
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "no healthy decode worker" in error.details()
    assert time.monotonic() - started < 2.0


def test_unhealthy_report_and_recovery(fake_server, start_router) -> None:
    decode = FakeDecode()
    decode.info.healthy = False
    server, stub, _, _ = _pd(fake_server, start_router, decode)
    try:
        list(stub.Generate(REQUEST, timeout=10))
        raise AssertionError("expected an error")
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.UNAVAILABLE
    decode.info.healthy = True
    # the router's next poll (every 0.5 s) sees the worker healthy again
    eventually(lambda: all(c.healthy for c in server.pool.candidates(["decode"])), 10, what="the decode worker healthy")
    assert list(stub.Generate(REQUEST, timeout=10))[-1].finish_reason == common_pb2.FINISH_REASON_STOP


def test_client_cancel_cancels_the_decode_call(fake_server, start_router) -> None:
    decode = FakeDecode(mode="hang")
    server, stub, _, _ = _pd(fake_server, start_router, decode)
    call = stub.Generate(REQUEST, timeout=30)
    assert next(call).text == "x"
    call.cancel()
    assert decode.cancelled.wait(2.0), "decode worker did not see the cancellation"
    deadline = time.monotonic() + 2.0
    while server.pool.in_flight_total() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.pool.in_flight_total() == 0
    while server.metrics.in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.metrics.outcomes == {"CANCELLED": 1}


def test_get_status_lists_workers(fake_server, start_router) -> None:
    decode = FakeDecode()
    decode.info.kv_blocks_total = 64
    decode.info.worker_id = "d0"
    _, stub, prefill, (decode_address,) = _pd(fake_server, start_router, decode)
    list(stub.Generate(REQUEST, timeout=10))
    status = stub.GetStatus(router_pb2.StatusRequest(), timeout=5)
    by_address = {w.address: w for w in status.workers}
    assert by_address[prefill].role == common_pb2.WORKER_ROLE_PREFILL and by_address[prefill].healthy
    assert by_address[decode_address].worker_id == "d0" and by_address[decode_address].kv_blocks_total == 64
    assert status.total_requests == 1 and status.in_flight_requests == 0


def test_metrics_record_ttft_itl_and_outcomes(fake_server, start_router) -> None:
    server, stub, _, _ = _pd(fake_server, start_router, FakeDecode())
    list(stub.Generate(REQUEST, timeout=10))
    summaries = server.metrics.summaries()
    assert summaries["ttft"].count == 1 and summaries["itl"].count == 2 and summaries["e2e"].count == 1
    assert server.metrics.outcomes["FINISH_REASON_STOP"] == 1 and server.metrics.in_flight == 0


def test_reflection_lists_router_service(start_router) -> None:
    server, _ = start_router(RouterConfig())
    with grpc.insecure_channel(server.address) as channel:
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert "pdserve.v1.Router" in services and "grpc.health.v1.Health" in services


def test_importing_router_does_not_import_torch() -> None:
    code = (
        "import sys, pdserve.router, pdserve.router.server, pdserve.router.__main__\n"
        "bad = [m for m in ('torch', 'transformers', 'pdserve.engine') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)


def test_router_process_prints_ready_line_and_stops_on_sigterm(fake_server) -> None:
    colocated = fake_server(FakeDecode(role=common_pb2.WORKER_ROLE_COLOCATED))
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.router", "--port", "0", "--colocated", colocated],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("PDSERVE_READY ")
        ready = json.loads(line.split(" ", 1)[1])
        assert ready["worker_id"] == "router" and ready["pid"] == proc.pid
        assert ready["address"].startswith("127.0.0.1:") and not ready["address"].endswith(":0")
        with grpc.insecure_channel(ready["address"]) as channel:
            status = channel.unary_unary("/pdserve.v1.Router/GetStatus")(b"", timeout=5)
        assert colocated.encode() in status
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_request_that_breaks_the_prefill_step_blames_the_request_not_the_worker(fake_server, start_router) -> None:
    """Issue 29 row 1: the prefill worker is not marked unhealthy for a request's own fault; the request
    is tried once more, on another pair, then fails alone (INTERNAL); others keep being served."""
    first, second = FakeDecode(mode="prefill_internal"), FakeDecode(mode="prefill_internal")
    server, stub, prefill, _ = _pd(fake_server, start_router, first, second)
    started = time.monotonic()
    try:
        list(stub.Generate(REQUEST, timeout=30))
        raise AssertionError("expected an error")
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.INTERNAL
        assert "failed the same way on two workers" in error.details() and "poisoned prompt" in error.details()
    assert len(first.requests) + len(second.requests) == 2  # tried twice, then given up
    assert all(w.healthy for w in server.core.pool.snapshot())  # nobody suspected: the prefill worker neither
    first.mode = second.mode = "ok"
    assert [r.text for r in stub.Generate(REQUEST, timeout=10)] == [r.text for r in SCRIPT]  # no 503
    assert time.monotonic() - started < 10


def test_n_choices_go_to_the_first_choices_decode_worker_without_a_prefill(fake_server, start_router) -> None:
    """n=3 over gRPC: choice 0 is prefilled by the prefill worker; choices 1 and 2 go to the decode
    worker that produced choice 0's first token, with no prefill worker (it holds the prompt's
    blocks), even under round robin; seeds are seed + i; every response names its choice."""
    decodes = [FakeDecode(), FakeDecode()]
    _, stub, prefill, _ = _pd(fake_server, start_router, *decodes)
    request = router_pb2.GenerateRequest(
        prompt="Hello", params=common_pb2.SamplingParams(max_tokens=3, n=3, seed=40, temperature=1.0)
    )
    responses = list(stub.Generate(request, timeout=10))
    by_choice = {i: [r.text for r in responses if r.index == i] for i in range(3)}
    assert by_choice == {i: [r.text for r in SCRIPT] for i in range(3)}
    assert sum(1 for r in responses if r.finish_reason) == 3
    first, other = decodes if decodes[0].requests else decodes[::-1]
    assert not other.requests and len(first.requests) == 3
    assert [r.prefill_address for r in first.requests] == [prefill, "", ""]
    assert sorted(r.params.seed for r in first.requests) == [40, 41, 42]
    assert all(r.params.n == 0 for r in first.requests)  # a worker gets one choice each
