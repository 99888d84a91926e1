"""`pdserve serve` stopped under load stops in order and silently (issue 55, part 3): the router
drains first (new requests 503, open streams finish or fail typed within `--router-drain-timeout`),
then the workers stop. Real processes serving the default model 1P1D, real HTTP streams, a real
Ctrl-C to the whole process group (as a terminal sends it) or a SIGTERM to `pdserve serve` alone.

Asserted: exit status 0; short streams finish with [DONE]; long ones end with OpenAI's error event
(`service_unavailable`) and [DONE], never a cut connection; a request sent during the drain gets a
JSON 503; the logs hold no traceback, no ERROR, no leaked-semaphore warning, no worker marked
unhealthy and no KV-target retry; no process of the deployment (the router's request parser
included) is left, and no shared-memory segment of theirs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

DRAIN_S = 3.0
LOUD = ("Traceback", " ERROR ", "leaked", "registering KV targets", "is now unhealthy", "KeyError")


def session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes of session `sid`."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:  # state, ppid, pgrp, session
            pids.append(int(entry))
    return pids


def stream(url: str, model: str, max_tokens: int, out: list[tuple[str, str]]) -> None:
    """One streamed completion; appends (how it ended, the last event) to `out`."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    request = urllib.request.Request(
        url + "/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    last = ""
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            for raw in answer:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    out.append(("done", last))
                    return
                if line.startswith("data: "):
                    last = line[len("data: ") :]
        out.append(("cut", last))
    except Exception as exc:  # noqa: BLE001 - what the test reports
        out.append(("cut", repr(exc)))


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url + "/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("how", ["ctrl-c-to-the-group", "sigterm-to-serve"])
def test_a_loaded_1p1d_deployment_stops_in_order_and_silently(tmp_path: Path, how: str) -> None:
    log_dir = tmp_path / "logs"
    serve = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cluster.cli", "serve", "--port", "0", "--http-port", "0"]
        + ["--threads-per-worker", "1", "--log-dir", str(log_dir), "--router-drain-timeout", str(DRAIN_S)],
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / "serve.err", "wb"),  # noqa: SIM115 - the child holds it
        text=True,
        start_new_session=True,  # its own process group and session, as a terminal gives it
    )
    try:
        lines: list[str] = []
        while not lines or "OpenAI-compatible API" not in lines[-1]:
            line = serve.stdout.readline()  # type: ignore[union-attr]
            assert line, f"serve exited early: {lines}\n{(tmp_path / 'serve.err').read_text()}"
            lines.append(line.strip())
        url = lines[-1].split()[-1]
        model = json.load(urllib.request.urlopen(url + "/models"))["data"][0]["id"]
        # a body over the inline limit: the router parses it in its parser process (now started)
        assert post(url, {"model": model, "prompt": "word " * 20_000, "max_tokens": 1})[0] == 400
        processes = session_pids(serve.pid)
        assert len(processes) >= 5, processes  # serve, router, 2 workers, the parser

        ends: list[tuple[str, str]] = []
        long_streams = [threading.Thread(target=stream, args=(url, model, 2000, ends)) for _ in range(2)]
        for t in long_streams:
            t.start()
        time.sleep(1.5)  # the long streams are decoding
        short: list[tuple[str, str]] = []
        short_streams = [threading.Thread(target=stream, args=(url, model, 12, short)) for _ in range(2)]
        for t in short_streams:
            t.start()
        time.sleep(0.2)
        stopped_at = time.monotonic()
        if how == "ctrl-c-to-the-group":
            os.killpg(serve.pid, signal.SIGINT)
        else:
            serve.send_signal(signal.SIGTERM)

        refused = None  # a new request during the drain: refused with a JSON 503
        while refused is None and time.monotonic() - stopped_at < DRAIN_S - 0.5:
            status, body = post(url, {"model": model, "prompt": "hi", "max_tokens": 2})
            if status == 503:
                refused = body
            else:
                assert status == 200, body  # sent before the router heard of the stop
                time.sleep(0.05)
        assert refused is not None and refused["error"]["type"] == "service_unavailable", refused

        assert serve.wait(timeout=DRAIN_S + 30) == 0
        took = time.monotonic() - stopped_at
        for t in long_streams + short_streams:
            t.join(timeout=30)
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()

    assert [how_ for how_, _ in short] == ["done", "done"], short
    assert all(json.loads(last)["choices"][0]["finish_reason"] == "length" for _, last in short), short
    assert [how_ for how_, _ in ends] == ["done", "done"], ends
    for _, last in ends:
        error = json.loads(last)["error"]
        assert error["type"] == "service_unavailable" and "shut down" in error["message"], error
    assert took < DRAIN_S + 15, f"stopping took {took:.1f} s"

    deadline = time.monotonic() + 10
    while session_pids(serve.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not session_pids(serve.pid), "processes outlived `pdserve serve`"
    left = [n for n in os.listdir("/dev/shm") if any(n.startswith(f"pdserve-kv-{p}-") for p in processes)]
    assert not left, left

    logs = {p.name: p.read_text(errors="replace") for p in sorted(log_dir.glob("*.log"))}
    logs["serve.err"] = (tmp_path / "serve.err").read_text(errors="replace")
    assert {"router.log", "prefill-0.log", "decode-0.log"} <= set(logs), sorted(logs)
    loud = {name: [line for line in text.splitlines() if any(k in line for k in LOUD)] for name, text in logs.items()}
    assert not any(loud.values()), loud
    assert "were ended: UNAVAILABLE" in logs["router.log"], logs["router.log"][-2000:]
