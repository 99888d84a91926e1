"""Router overhead per token: a stream through the router (gRPC, and the OpenAI HTTP API) against the
same stream straight from the decode worker, measured in one run.

A stand-in decode worker (a separate process, no model: it only answers DecodeWorker.Generate and
GetInfo) sends `--tokens` tokens per stream, one every `--interval-ms`, each carrying its send time
(ns since the epoch) as its text. The client (this process, asyncio) opens K concurrent streams
(`--streams`, e.g. 1 and 256) three ways and records, for every token, receive time - send time:

  direct   DecodeWorker.Generate on the stand-in
  router   Router.Generate on a real router process (`python -m pdserve.router --colocated STAND-IN`)
  http     POST /v1/completions with stream=true on that router's HTTP API

Added latency per token = p50(router) - p50(direct), and p50(http) - p50(router). The stand-in
keeps the engine out of the picture, so what is left is the relay itself. With `--loops asyncio
uvloop` one router per event-loop kind is started (PDSERVE_EVENT_LOOP), with `--transports generate
mux` one router per transport to the stand-in (a Generate call per stream, or router --decode-mux's
GenerateMux stream, which carries the tokens of one tick in one message), and all are measured in
the same interleaved rounds. The router's CPU time per relayed token (from /proc) is printed beside
the latencies: it moves much less than they do with what else the machine runs. Example:

  python benchmarks/router_overhead.py --streams 1 256 --tokens 30 --interval-ms 100 --loops asyncio uvloop
  python benchmarks/router_overhead.py --streams 1 256 --tokens 30 --interval-ms 100 --transports generate mux

`--router-cpu N` pins the routers to CPU N and everything else (client, stand-in) to the other CPUs,
as a router deployed on its own core or machine runs: then the added latency is the relay's own
cost, not the wait for a CPU that the client and the stand-in hold.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import grpc

from pdserve.cluster.processes import ManagedProcess
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

STAND_IN = r"""
import asyncio, sys, time, grpc
from pdserve.serving import ready_line
from pdserve.decode_worker.mux import serve_mux
from pdserve.v1 import common_pb2, router_pb2, worker_pb2_grpc

TOKENS, INTERVAL, ALIGNED = int(sys.argv[1]), float(sys.argv[2]) / 1000, sys.argv[3] == "aligned"

class StandIn(worker_pb2_grpc.DecodeWorkerServicer):
    async def Generate(self, request, context):
        n = request.params.max_tokens or TOKENS
        loop = asyncio.get_running_loop()
        for i in range(n):
            # aligned: on a shared clock, every stream's token of a tick goes out together, as a decode
            # step's do; free: each stream's own clock (started when its call arrived)
            await asyncio.sleep(INTERVAL - loop.time() % INTERVAL if ALIGNED else INTERVAL)
            last = i == n - 1
            yield router_pb2.GenerateResponse(
                text=f"{time.time_ns()} ", token_ids=[i % 100],
                finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0,
                usage=common_pb2.Usage(prompt_tokens=1, completion_tokens=n) if last else None)

    async def GenerateMux(self, request_iterator, context):
        await serve_mux(self.Generate, request_iterator, context)

    def GetInfo(self, request, context):
        return common_pb2.WorkerInfo(healthy=True, role=common_pb2.WORKER_ROLE_COLOCATED)

async def main():
    server = grpc.aio.server()
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(StandIn(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(ready_line(f"127.0.0.1:{port}", "stand-in"), flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


def _latencies(texts: list[str], received_ns: list[int]) -> list[float]:
    """ms from each token's send stamp to its arrival here."""
    out = []
    for text, at in zip(texts, received_ns, strict=True):
        for stamp in text.split():
            out.append((at - int(stamp)) / 1e6)
    return out


async def _grpc_stream(call) -> list[float]:  # noqa: ANN001
    texts, received = [], []
    async for response in call:
        if response.text:
            texts.append(response.text)
            received.append(time.time_ns())
    return _latencies(texts, received)


async def _http_stream(session: aiohttp.ClientSession, url: str, tokens: int) -> list[float]:
    body = {"model": "default", "prompt": "x", "max_tokens": tokens, "stream": True}
    texts, received = [], []
    async with session.post(url, json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if line.startswith(b"data: {"):
                text = json.loads(line[6:])["choices"][0]["text"]
                if text:
                    texts.append(text)
                    received.append(time.time_ns())
    return _latencies(texts, received)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(mode: str, streams: int, tokens: int, stand_in: str, router: str, http: str) -> list[float]:
    params = common_pb2.SamplingParams(max_tokens=tokens)
    if mode == "http":
        connector = aiohttp.TCPConnector(limit=streams)
        async with aiohttp.ClientSession(connector=connector) as session:
            runs = await asyncio.gather(
                *(_http_stream(session, f"http://{http}/v1/completions", tokens) for _ in range(streams))
            )
    else:
        async with grpc.aio.insecure_channel(stand_in if mode == "direct" else router) as channel:
            if mode == "direct":
                worker = worker_pb2_grpc.DecodeWorkerStub(channel)
                calls = [
                    worker.Generate(worker_pb2.DecodeRequest(request_id=f"d{i}", prompt="x", params=params))
                    for i in range(streams)
                ]
            else:
                router_stub = router_pb2_grpc.RouterStub(channel)
                calls = [
                    router_stub.Generate(router_pb2.GenerateRequest(prompt="x", params=params)) for _ in range(streams)
                ]
            runs = await asyncio.gather(*(_grpc_stream(c) for c in calls))
    return [x for run in runs for x in run]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--tokens", type=int, default=50, help="tokens per stream")
    ap.add_argument("--interval-ms", type=float, default=20.0, help="gap between a stream's tokens")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of (direct, router, http) per stream count")
    ap.add_argument(
        "--loops",
        nargs="+",
        default=["default"],
        choices=["default", "asyncio", "uvloop"],
        help="event loop of the router under test (one router each, measured side by side)",
    )
    ap.add_argument(
        "--tick",
        choices=["free", "aligned"],
        default="free",
        help="stand-in clock: free = each stream ticks from its own start (the calls arrive spread "
        "over a few ms, so a tick's tokens trickle); aligned = all streams tick together, the "
        "burst of a decode step",
    )
    ap.add_argument(
        "--transports",
        nargs="+",
        default=["generate"],
        choices=["generate", "mux"],
        help="router -> stand-in transport: a Generate call per stream, or one GenerateMux stream "
        "(router --decode-mux); one router each, measured side by side",
    )
    ap.add_argument(
        "--router-cpu",
        type=int,
        default=None,
        metavar="CPU",
        help="pin the routers to this CPU and the client and stand-in to the others (Linux), as a "
        "router on its own machine or core would run; default: no pinning, all share all CPUs",
    )
    args = ap.parse_args()
    pin: list[str] = []
    if args.router_cpu is not None:
        cpus = os.sched_getaffinity(0)
        if args.router_cpu not in cpus or len(cpus) < 2:
            ap.error(
                f"--router-cpu {args.router_cpu}: need it among this process's CPUs {sorted(cpus)}, "
                "with at least one other left for the client and stand-in"
            )
        os.sched_setaffinity(0, cpus - {args.router_cpu})  # the stand-in inherits it
        pin = ["taskset", "-c", str(args.router_cpu)]  # every router thread, from its first
    logs = Path(tempfile.mkdtemp(prefix="pdserve-overhead-"))
    stand_in = ManagedProcess(
        "stand-in",
        [sys.executable, "-c", STAND_IN, str(args.tokens), str(args.interval_ms), args.tick],
        logs / "stand-in.log",
    )
    processes = [stand_in]
    try:
        stand_in_address = str(stand_in.wait_ready(60)["address"])
        routers: dict[str, tuple[str, str, int]] = {}
        for loop in args.loops:
            for transport in args.transports:
                env = dict(os.environ)
                if loop != "default":
                    env["PDSERVE_EVENT_LOOP"] = loop
                name = loop if transport == "generate" else f"{loop}-mux"
                extra = ["--decode-mux"] if transport == "mux" else []
                router = ManagedProcess(
                    f"router-{name}",
                    [
                        *pin,
                        sys.executable,
                        "-m",
                        "pdserve.router",
                        "--port",
                        "0",
                        "--http-port",
                        "0",
                        "--colocated",
                        stand_in_address,
                        "--max-concurrent-streams",
                        "1024",
                        "--log-level",
                        "WARNING",
                        *extra,
                    ],
                    logs / f"router-{name}.log",
                    env=env,
                )
                processes.append(router)
                ready = router.wait_ready(60)
                routers[name] = (str(ready["address"]), str(ready["http_address"]), int(str(ready["pid"])))
        print(
            f"{'streams':>7} {'mode':>16} {'p50 ms':>8} {'p90 ms':>8} {'added p50 ms':>13} {'router CPU us/token':>20}"
        )
        for streams in args.streams:
            modes = ["direct"] + [f"{kind}/{loop}" for loop in routers for kind in ("router", "http")]
            samples: dict[str, list[float]] = {m: [] for m in modes}
            cpu: dict[str, float] = {m: 0.0 for m in modes}
            for _ in range(args.repeats):  # interleaved, so drift hits every mode alike
                for mode in modes:
                    kind, _, loop = mode.partition("/")
                    router_address, http_address, pid = routers.get(loop, ("", "", 0))
                    before = _cpu_s(pid) if pid else 0.0
                    samples[mode] += asyncio.run(
                        measure(kind, streams, args.tokens, stand_in_address, router_address, http_address)
                    )
                    cpu[mode] += (_cpu_s(pid) - before) if pid else 0.0
            p50 = {m: statistics.median(v) for m, v in samples.items()}
            for mode, values in samples.items():
                kind, _, loop = mode.partition("/")
                base = {"direct": None, "router": "direct", "http": f"router/{loop}"}[kind]
                added = f"{p50[mode] - p50[base]:13.3f}" if base else f"{'':>13}"
                p90 = statistics.quantiles(values, n=10)[-1]
                per_token = f"{cpu[mode] / len(values) * 1e6:20.1f}" if loop else f"{'':>20}"
                print(f"{streams:>7} {mode:>16} {p50[mode]:8.3f} {p90:8.3f} {added} {per_token}  (vs {base or '-'})")
    finally:
        for process in processes:
            process.terminate()
        subprocess.run(["true"], check=False)


if __name__ == "__main__":
    main()
