"""KV-aware routing against round robin, prefix affinity and an oracle, on a multi-turn chat workload.

The workload: conversations that share a few long system prompts and grow turn by turn (each turn's
prompt is the system prompt, every earlier turn with its real output, and a new user message).
Conversations start at random times and come back after a think time, so other traffic runs between
two turns of one conversation. Prompts are token ids cut from pdserve's corpus; the same workload
(same seed) runs against every policy, each on a fresh cluster, one after another in one run.

Policies (the same one for both stages): round_robin, prefix_affinity, kv_aware (with conditional
disaggregation at --threshold tokens), kv_aware_always (kv_aware that always disaggregates) and
kv_oracle (kv_aware's cost with every worker's exact overlap asked at routing time).

Reported per policy: prefix-cache hit rate (cached / prompt tokens, from each response's usage), the
same on follow-up turns, TTFT and TPOT p50/p90, goodput (requests per second meeting both SLOs),
the prompt tokens that crossed the network to decode workers (their KV bytes received / bytes per
token), and the route decisions.

Engines: `--engine sim` runs the simulated engine (a profile's timings; no model compute), with
`--speedup` < 1 to slow modelled time so that 2 CPU cores keep up; times are reported in profile
time. `--engine model` runs the real model (default: the default model).

    python benchmarks/kv_routing_bench.py --topology 2p6d 4p4d --json out.json
    python benchmarks/kv_routing_bench.py --engine model --topology 1p1d x2 --conversations 12

A sweep of kv_aware's weights and threshold: `--sweep` runs kv_aware once per point (the defaults,
then each of --sweep-threshold, --sweep-request-tokens and --sweep-kv-tokens varied alone), after
the --policies, on the same workload.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from kv_router_cost import cpu  # the same folder: the CPU model and its vector flags

from pdserve.cluster.engine_flags import sim_worker_args
from pdserve.cluster.launch import LaunchOptions, local_deployment
from pdserve.cluster.local import LocalCluster
from pdserve.settings import RouterSection
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

POLICIES = ("round_robin", "prefix_affinity", "kv_aware", "kv_aware_always", "kv_oracle", "kv_aware_slo")
DEFAULT_POLICIES = POLICIES[:5]
TOPOLOGIES = {"1p1d": (1, 1, 0), "2p6d": (2, 6, 0), "4p4d": (4, 4, 0), "x2": (0, 0, 2)}
PROFILE = Path(__file__).resolve().parent.parent / "capacity" / "profiles" / "h100-llama-3.1-8b.json"


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft: float | None = None
    tpot: float | None = None
    error: str = ""
    done_at: float = 0.0
    shed_wall_s: float | None = None  # refused by SLO admission: how long the refusal took (wall clock)
    route: str = ""  # --trace-routes: the router's decision
    shipped_tokens: int | None = None  # --trace-routes: prompt tokens whose K/V went to the decode worker


@dataclass
class Workload:
    systems: list[list[int]]
    users: list[list[list[int]]]  # per conversation, per turn
    starts: list[float]  # profile seconds
    thinks: list[list[float]]
    output_len: int
    turns: list[Turn] = field(default_factory=list)


def corpus_ids() -> list[int]:
    from pdserve.capacity.bench import load_corpus_ids

    return load_corpus_ids(None)


def make_workload(args: argparse.Namespace) -> Workload:
    ids = corpus_ids()
    rng = random.Random(args.seed)

    def cut(n: int) -> list[int]:
        start = rng.randrange(len(ids))
        return [ids[(start + i) % len(ids)] for i in range(n)]

    systems = [cut(args.system_tokens) for _ in range(args.systems)]
    users = [[cut(rng.randint(*args.user_tokens)) for _ in range(args.turns)] for _ in range(args.conversations)]
    starts, t = [], 0.0
    for _ in range(args.conversations):
        t += rng.expovariate(args.rate)
        starts.append(t)
    thinks = [[rng.expovariate(1 / args.think_s) for _ in range(args.turns)] for _ in range(args.conversations)]
    return Workload(systems, users, starts, thinks, args.output_len)


async def run_workload(
    address: str, work: Workload, speedup: float, timeout_s: float, trace_routes: bool = False
) -> list[Turn]:
    turns: list[Turn] = []
    t0 = time.perf_counter()

    async def conversation(stub: router_pb2_grpc.RouterStub, c: int) -> None:
        history = list(work.systems[c % len(work.systems)])
        await asyncio.sleep(work.starts[c] / speedup)
        for k, user in enumerate(work.users[c]):
            history += user
            turn = Turn(c, k, prompt_tokens=len(history))
            turns.append(turn)
            request = router_pb2.GenerateRequest(
                token_ids=common_pb2.TokenIds(ids=history),
                request_id=f"c{c}-t{k}",
                trace=trace_routes,
                params=common_pb2.SamplingParams(max_tokens=work.output_len, ignore_eos=True, temperature=0.0),
            )
            start = last = time.perf_counter()
            output: list[int] = []
            try:
                async for response in stub.Generate(request, timeout=timeout_s):
                    now = time.perf_counter()
                    if response.token_ids and turn.ttft is None:
                        turn.ttft = (now - start) * speedup
                    last = now if response.token_ids else last
                    output += response.token_ids
                    if response.finish_reason:
                        turn.cached_tokens = response.usage.cached_tokens
                    for event in response.trace:
                        if event.HasField("route"):
                            route = event.route
                            turn.route = route.decision
                            # what the decode worker lacked crossed the network, unless it prefilled here
                            turn.shipped_tokens = (
                                route.prompt_tokens - route.decode_cached_tokens if route.prefill_worker else 0
                            )
                if len(output) > 1 and turn.ttft is not None:
                    turn.tpot = ((last - start) * speedup - turn.ttft) / (len(output) - 1)
            except grpc.aio.AioRpcError as exc:
                turn.error = f"{exc.code().name}: {exc.details()}"
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "SLO" in (exc.details() or ""):
                    turn.shed_wall_s = time.perf_counter() - start
                return
            turn.done_at = (time.perf_counter() - t0) * speedup
            history += output
            await asyncio.sleep(work.thinks[c][k] / speedup)

    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        await asyncio.gather(*(conversation(stub, c) for c in range(len(work.users))))
    return turns


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _metric(address: str, name: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name):
            key, value = line.rsplit(" ", 1)
            out[key[len(name) :]] = float(value)
    return out


def follow_ups(turns: list[Turn]) -> list[Turn]:
    return [t for t in turns if t.turn > 0]


def summarize(turns: list[Turn], slo_ttft: float, slo_tpot: float) -> dict[str, Any]:
    ok = [t for t in turns if not t.error and t.ttft is not None]
    shed = [t.shed_wall_s for t in turns if t.shed_wall_s is not None]
    traced = [t for t in follow_ups(ok) if t.shipped_tokens is not None]
    follow = [t for t in ok if t.turn > 0]
    duration = max((t.done_at for t in ok), default=0.0)
    ttft = [t.ttft for t in ok if t.ttft is not None]  # every one of `ok`
    good = [t for t in ok if t.ttft is not None and t.ttft <= slo_ttft and (t.tpot is None or t.tpot <= slo_tpot)]
    tpot = [t.tpot for t in ok if t.tpot is not None]
    return {
        "requests": len(turns),
        "errors": len(turns) - len(ok),
        "hit_rate": sum(t.cached_tokens for t in ok) / max(1, sum(t.prompt_tokens for t in ok)),
        "follow_up_hit_rate": sum(t.cached_tokens for t in follow) / max(1, sum(t.prompt_tokens for t in follow)),
        "ttft_p50": _pct(ttft, 0.5),
        "ttft_p90": _pct(ttft, 0.9),
        "tpot_p50": _pct(tpot, 0.5),
        "tpot_p90": _pct(tpot, 0.9),
        "goodput_rps": len(good) / duration if duration else 0.0,
        "slo_attainment": len(good) / max(1, len(turns)),
        "shed": len(shed),
        "admitted_slo_attainment": len(good) / max(1, len(turns) - len(shed)),
        "shed_answer_ms_p50": _pct(shed, 0.5) * 1e3 if shed else None,
        "shed_answer_ms_max": max(shed) * 1e3 if shed else None,
        "duration_s": duration,
        "prompt_tokens": sum(t.prompt_tokens for t in ok),
        "follow_up_network_share": (
            sum(t.shipped_tokens or 0 for t in traced) / max(1, sum(t.prompt_tokens for t in traced))
            if traced
            else None
        ),
    }


@dataclass(frozen=True)
class Point:
    """kv_aware's settings for one run (--sweep)."""

    threshold: int
    request_tokens: float
    kv_tokens: float


def sweep_points(args: argparse.Namespace) -> list[Point]:
    """The defaults, then one setting varied at a time."""
    base = Point(args.threshold, args.request_tokens, args.kv_tokens)
    points = [base]
    points += [Point(t, base.request_tokens, base.kv_tokens) for t in args.sweep_threshold]
    points += [Point(base.threshold, r, base.kv_tokens) for r in args.sweep_request_tokens]
    points += [Point(base.threshold, base.request_tokens, k) for k in args.sweep_kv_tokens]
    return points


def run_policy(
    policy: str,
    topology: str,
    work: Workload,
    args: argparse.Namespace,
    profile: str | None,
    kv_bytes_per_token: float,
    point: Point | None = None,
) -> dict[str, Any]:
    prefill, decode, colocated = TOPOLOGIES[topology]
    name = "kv_aware" if policy in ("kv_aware_always", "kv_aware_slo") else policy
    point = point or Point(args.threshold, args.request_tokens, args.kv_tokens)
    router_args: tuple[str, ...] = ()
    if name in ("kv_aware", "kv_oracle"):
        router_args = (
            "--kv-aware-request-tokens",
            repr(point.request_tokens),
            "--kv-aware-kv-tokens",
            repr(point.kv_tokens),
        )
    if policy in ("kv_aware", "kv_oracle", "kv_aware_slo"):
        router_args += ("--conditional-disagg-tokens", str(point.threshold))
    elif policy == "kv_aware_always":  # whatever the router's default threshold is
        router_args += ("--conditional-disagg-tokens", "0")
    if policy == "kv_aware_slo":  # the router's clock is the wall clock: the SLO in wall seconds
        router_args += ("--slo-ttft", repr(args.slo_ttft / (args.speedup if profile else 1.0)))
    engine = sim_worker_args(profile, args.speedup) if profile else ()
    config = local_deployment(
        model=args.model,
        prefill=prefill,
        decode=decode,
        colocated=colocated,
        threads_per_worker=1,
        prefill_policy=name,
        decode_policy=name,
        metrics=True,
        startup_timeout_s=900.0,
    )
    options = LaunchOptions(prefill_args=engine, decode_args=engine, router_args=router_args)
    with LocalCluster(config, options) as cluster:
        started = time.perf_counter()
        turns = asyncio.run(
            run_workload(
                cluster.router_address, work, args.speedup if profile else 1.0, args.timeout_s, args.trace_routes
            )
        )
        wall = time.perf_counter() - started
        router = cluster.metrics_addresses["router"]
        routes = {k.split('"')[1]: v for k, v in _metric(router, "pdserve_route_decisions_total").items() if '"' in k}
        metrics = {
            "shipped": _metric(router, "pdserve_route_shipped_tokens_total"),
            "shed_answer": _metric(router, "pdserve_slo_shed_answer_seconds"),
        }
        stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router_address))
        status = stub.GetStatus(router_pb2.StatusRequest(), timeout=10)
    summary = summarize(turns, args.slo_ttft, args.slo_tpot)
    summary.update(
        policy=policy,
        topology=topology,
        wall_s=wall,
        routes=routes,
        threshold=point.threshold,
        request_tokens=point.request_tokens,
        kv_tokens=point.kv_tokens,
    )
    # the router's own time from receipt to refusal (the client's figure adds its own event loop's lag)
    shed_answer = metrics["shed_answer"]
    refused = shed_answer.get("_count", 0.0)
    summary["router_shed_answer_ms_mean"] = shed_answer.get("_sum", 0.0) / refused * 1e3 if refused else None
    summary["router_shed_within_50ms"] = shed_answer.get('_bucket{le="0.05"}', 0.0) / refused if refused else None
    # prompt tokens whose K/V crossed to a decode worker: measured (its KV bytes received) with the model
    # engine; the sim engine models transfers without bytes, so there the router's count of what the
    # chosen decode worker lacked (KV-aware policies only) stands in
    received = sum(w.kv_bytes_received for w in status.workers)
    shipped = sum(metrics["shipped"].values()) if name in ("kv_aware", "kv_oracle") else None
    crossed = shipped if profile else received / kv_bytes_per_token
    summary["network_tokens"] = crossed
    summary["network_share"] = (
        crossed / summary["prompt_tokens"] if crossed is not None and summary["prompt_tokens"] else None
    )
    return summary


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("sim", "model"), default="sim")
    ap.add_argument("--model", default=None, help="model folder (default: the default model)")
    ap.add_argument("--profile", default=str(PROFILE), help="sim engine profile (default: the H100 Llama-3.1-8B one)")
    ap.add_argument(
        "--kv-capacity-tokens",
        type=int,
        default=24_000,
        help="sim: KV capacity per worker, in tokens (small, so that caches evict; default 24000)",
    )
    ap.add_argument(
        "--speedup",
        type=float,
        default=0.25,
        help="sim: modelled time runs this much faster than "
        "wall time (< 1: slower, so that the CPU keeps up; default 0.25)",
    )
    ap.add_argument("--topology", nargs="+", default=["2p6d", "4p4d"], choices=sorted(TOPOLOGIES))
    ap.add_argument(
        "--policies",
        nargs="+",
        default=list(DEFAULT_POLICIES),
        choices=POLICIES,
        help="kv_aware_slo: kv_aware with SLO admission at --slo-ttft (default: all but that one)",
    )
    ap.add_argument("--systems", type=int, default=8, help="distinct system prompts")
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user-tokens", type=int, nargs=2, default=(64, 256), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rate", type=float, default=8.0, help="conversations started per second (profile time)")
    ap.add_argument("--think-s", type=float, default=1.0, help="mean think time between turns (profile time)")
    ap.add_argument(
        "--threshold",
        type=int,
        default=512,
        help="--conditional-disagg-tokens of kv_aware (default 512: the best on the sim's H100 profile; "
        "the router's own default is 0, always disaggregate: the best measured on a CPU)",
    )
    ap.add_argument(
        "--request-tokens", type=float, default=RouterSection.kv_aware_request_tokens, help="--kv-aware-request-tokens"
    )
    ap.add_argument("--kv-tokens", type=float, default=RouterSection.kv_aware_kv_tokens, help="--kv-aware-kv-tokens")
    ap.add_argument("--sweep", action="store_true", help="also run kv_aware at each sweep point")
    ap.add_argument("--sweep-threshold", type=int, nargs="*", default=[0, 128, 256, 1024])
    ap.add_argument("--sweep-request-tokens", type=float, nargs="*", default=[32.0, 512.0])
    ap.add_argument("--sweep-kv-tokens", type=float, nargs="*", default=[128.0, 2048.0])
    ap.add_argument("--slo-ttft", type=float, default=0.2, help="TTFT SLO for goodput (s, profile time)")
    ap.add_argument("--slo-tpot", type=float, default=0.05, help="TPOT SLO for goodput (s, profile time)")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--trace-routes",
        action="store_true",
        help="trace every request to read the router's decision and the tokens it shipped per turn "
        "(adds the trace's cost to every request)",
    )
    ap.add_argument("--json", default=None, help="write every result here")
    args = ap.parse_args()
    profile, bytes_per_token = None, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        if args.engine == "sim":
            doc = json.loads(Path(args.profile).read_text())
            doc["engine"]["kv_capacity_tokens"] = args.kv_capacity_tokens
            profile = str(Path(tmp) / "profile.json")
            Path(profile).write_text(json.dumps(doc))
            bytes_per_token = float(doc["model"]["kv_bytes_per_token"])
        else:
            from pdserve.engine.model_fetch import resolve_model

            cfg = json.loads((resolve_model(args.model) / "config.json").read_text())
            heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
            head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
            bytes_per_token = cfg["num_hidden_layers"] * 2 * heads * head_dim * 4  # fp32 K and V
        work = make_workload(args)
        print(
            f"CPU: {cpu()}; engine {args.engine}; {args.conversations} conversations x {args.turns} turns, "
            f"{args.systems} system prompts of {args.system_tokens} tokens",
            flush=True,
        )
        results = []
        for topology in args.topology:
            runs: list[tuple[str, Point | None]] = [(policy, None) for policy in args.policies]
            runs += [("kv_aware", point) for point in sweep_points(args)] if args.sweep else []
            for policy, point in runs:
                result = run_policy(policy, topology, work, args, profile, bytes_per_token, point)
                results.append(result)
                label = (
                    policy
                    if point is None
                    else (f"kv_aware t={point.threshold} r={point.request_tokens:g} k={point.kv_tokens:g}")
                )
                print(
                    f"{topology:>5} {label:<16} hit {result['hit_rate']:.3f} (follow-ups "
                    f"{result['follow_up_hit_rate']:.3f})  TTFT p50/p90 {result['ttft_p50'] * 1e3:.1f}/"
                    f"{result['ttft_p90'] * 1e3:.1f} ms  TPOT p50/p90 {result['tpot_p50'] * 1e3:.1f}/"
                    f"{result['tpot_p90'] * 1e3:.1f} ms  goodput {result['goodput_rps']:.2f} req/s  "
                    f"net share {_fmt(result['network_share'])} (follow-ups "
                    f"{_fmt(result['follow_up_network_share'])})  "
                    f"errors {result['errors']} (shed {result['shed']}, admitted attainment "
                    f"{result['admitted_slo_attainment']:.3f}, shed answer p50/max "
                    f"{_fmt(result['shed_answer_ms_p50'])}/{_fmt(result['shed_answer_ms_max'])} ms; router: "
                    f"mean {_fmt(result['router_shed_answer_ms_mean'])} ms, "
                    f"{_fmt(result['router_shed_within_50ms'])} within 50 ms)  "
                    f"routes {result['routes']}  ({result['wall_s']:.0f} s wall)",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu(), "args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
