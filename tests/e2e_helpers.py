"""Helpers for end-to-end tests: talk to a running service with the raw generated stubs."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from pdserve.transport import open_channel
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

WORDS = ("river mill evening children market flour dawn sea poem capital France story old light "
         "winter city mountain lake").split()


@dataclass
class Result:
    text: str
    token_ids: list[int]
    finish_reason: int
    responses: list[router_pb2.GenerateResponse]


def mixed_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.choice([1, 3, 8, 20, 60, 150]))) for _ in range(n)]


def generate(address: str, prompt: str, max_tokens: int, timeout: float = 300, **params: object) -> Result:
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(address))
    request = router_pb2.GenerateRequest(
        prompt=prompt, params=common_pb2.SamplingParams(max_tokens=max_tokens, **params))
    responses = list(stub.Generate(request, timeout=timeout))
    return Result("".join(r.text for r in responses), [t for r in responses for t in r.token_ids],
                  responses[-1].finish_reason, responses)


def generate_many(address: str, prompts: list[str], max_tokens: list[int]) -> list[Result]:
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        return list(pool.map(lambda pm: generate(address, pm[0], pm[1]), zip(prompts, max_tokens, strict=True)))


def worker_info(address: str, role: str) -> common_pb2.WorkerInfo:
    channel = open_channel(address)  # workers speak mTLS when the deployment configures it
    stub = (worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub)(channel)
    return stub.GetInfo(worker_pb2.InfoRequest(), timeout=10)


def wait_idle(workers: list[tuple[str, str]], timeout: float = 30) -> list[common_pb2.WorkerInfo]:
    """Poll until every worker holds no KV block and no request; return their final infos."""
    deadline = time.monotonic() + timeout
    while True:
        infos = [worker_info(address, role) for role, address in workers]
        if all(i.kv_blocks_used == 0 and i.running_requests == 0 and i.queue_depth == 0 for i in infos):
            return infos
        if time.monotonic() > deadline:
            raise AssertionError(f"workers not idle: {infos}")
        time.sleep(0.2)
