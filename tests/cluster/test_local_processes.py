"""Process management of LocalCluster (READY line, start failures, stop) with stand-in child scripts,
and the `pdserve generate` / `status` commands against a real router with a fake colocated worker."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from pdserve.cluster.cli import main
from pdserve.cluster.processes import ManagedProcess, ProcessStartError, parse_ready_line, stop_all
from pdserve.router.config import RouterConfig
from pdserve.router.server import serve
from pdserve.v1 import common_pb2, router_pb2, worker_pb2_grpc

READY = (
    'print("noise"); payload = {"address": "127.0.0.1:9", "worker_id": "w", "pid": os.getpid()}\n'
    'print("PDSERVE_READY " + json.dumps(payload), flush=True)'
)


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", f"import json, os, signal, sys, time\n{code}"]


def test_parse_ready_line() -> None:
    assert parse_ready_line('PDSERVE_READY {"address": "a:1", "worker_id": "x", "pid": 3, "role": "decode"}') == {
        "address": "a:1",
        "worker_id": "x",
        "pid": 3,
        "role": "decode",
    }
    assert parse_ready_line("some log line") is None
    with pytest.raises(ValueError):
        parse_ready_line('PDSERVE_READY {"worker_id": "x"}')


def test_ready_line_is_read_and_other_stdout_goes_to_log(tmp_path: Path) -> None:
    process = ManagedProcess("w", _py(READY + "\ntime.sleep(30)"), tmp_path / "w.log")
    try:
        ready = process.wait_ready(10)
        assert ready["address"] == "127.0.0.1:9" and ready["pid"] == process.pid
    finally:
        stop_all([process], 5)
    assert process.proc.returncode is not None
    assert "noise" in (tmp_path / "w.log").read_text()


def test_exit_before_ready_raises_with_stderr_tail(tmp_path: Path) -> None:
    process = ManagedProcess(
        "w", _py('print("model not found: /nope", file=sys.stderr); sys.exit(3)'), tmp_path / "w.log"
    )
    with pytest.raises(ProcessStartError, match=r"(?s)exited with code 3.*model not found: /nope"):
        process.wait_ready(10)
    stop_all([process], 1)


def test_ready_timeout(tmp_path: Path) -> None:
    process = ManagedProcess("w", _py("time.sleep(30)"), tmp_path / "w.log")
    started = time.monotonic()
    with pytest.raises(ProcessStartError, match="not ready after"):
        process.wait_ready(0.5)
    assert time.monotonic() - started < 5
    stop_all([process], 1)


def test_stop_kills_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    code = "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + READY + "\ntime.sleep(60)"
    process = ManagedProcess("stubborn", _py(code), tmp_path / "s.log")
    process.wait_ready(10)
    started = time.monotonic()
    stop_all([process], 0.5)
    assert process.proc.returncode == -9 and time.monotonic() - started < 5
    stop_all([process], 0.5)  # idempotent


class _Colocated(worker_pb2_grpc.DecodeWorkerServicer):
    def Generate(self, request, context):  # noqa: N802, ANN001
        if request.prompt == "fail":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "kv cache full")
        yield router_pb2.GenerateResponse(text="Hi", token_ids=[5])
        yield router_pb2.GenerateResponse(
            text=" there",
            token_ids=[6],
            finish_reason=common_pb2.FINISH_REASON_LENGTH,
            usage=common_pb2.Usage(prompt_tokens=1, completion_tokens=2),
        )

    def GetInfo(self, request, context):  # noqa: N802, ANN001
        return common_pb2.WorkerInfo(
            worker_id="colocated-0",
            healthy=True,
            kv_blocks_total=8,
            pid=42,
            kernels="own timing (this CPU (B) is not the table's (A))",
        )


@pytest.fixture(scope="module")
def router_address() -> Iterator[str]:
    worker = grpc.server(futures.ThreadPoolExecutor(4))
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(_Colocated(), worker)
    worker_address = f"127.0.0.1:{worker.add_insecure_port('127.0.0.1:0')}"
    worker.start()
    router, port = serve(RouterConfig(colocated=(worker_address,)))
    yield f"127.0.0.1:{port}"
    router.stop(None)
    worker.stop(None)


def test_cli_generate_streams_text(router_address: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--url", router_address, "--max-tokens", "2", "hello"]) == 0
    assert capsys.readouterr().out == "Hi there\n"


def test_cli_generate_json(router_address: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--url", router_address, "--json", "--chat", "hello"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    doc = json.loads(out[0])
    assert doc["text"] == "Hi there" and doc["token_ids"] == [5, 6] and doc["finish_reason"] == "length"
    assert doc["usage"]["completion_tokens"] == 2 and doc["timings"]["e2e_s"] > 0


def test_cli_generate_error(router_address: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--url", router_address, "fail"]) == 1
    assert capsys.readouterr().err.strip() == "error: RESOURCE_EXHAUSTED: kv cache full"
    assert main(["generate", "--url", router_address, "--top-p", "2", "x"]) == 1
    assert "error: INVALID_ARGUMENT: params.top_p" in capsys.readouterr().err


def test_cli_status(router_address: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--url", router_address]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "role",
        "worker_id",
        "address",
        "pid",
        "queue",
        "kv",
        "used/total",
        "running",
        "healthy",
    ]
    assert lines[1].split()[:2] == ["colocated", "colocated-0"] and "0/8" in lines[1] and lines[1].endswith("yes")
    assert "kernels: own timing (this CPU (B) is not the table's (A)): colocated-0" in lines  # which timed its own
    assert main(["status", "--url", router_address, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workers"][0]["role"] == "colocated" and doc["workers"][0]["healthy"] is True
