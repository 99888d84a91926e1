"""`usage.prompt_tokens_details.cached_tokens` and OpenAI logprobs / echo end to end: real router and worker
processes on loopback (1P1D and colocated) serving a tiny random Llama. A repeated prompt is served from
the prefix cache; log-probabilities equal Hugging Face's log_softmax of the fp32 logits within 1e-4."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.cluster.launch import LaunchOptions, local_deployment
from pdserve.cluster.local import LocalCluster
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

from e2e_helpers import worker_info

BLOCK_SIZE = 16  # the workers' default --block-size


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["1p1d", "1p1d-decode-cache-only", "1p1d-grpc-kv", "colocated"])
def cluster(request: pytest.FixtureRequest, tiny_llama_dir: Path) -> Iterator[LocalCluster]:
    # 1p1d: the same-host default, shm (the decode worker copies the K/V in place, before the prefill
    # worker's answer); 1p1d-grpc-kv: the K/V streamed over gRPC, the answer first
    topology = {
        "1p1d": dict(prefill=1, decode=1),
        "colocated": dict(prefill=0, decode=0, colocated=1),
        "1p1d-decode-cache-only": dict(prefill=1, decode=1),
        "1p1d-grpc-kv": dict(prefill=1, decode=1, kv_backend="grpc"),
    }
    # only the decode worker's reused blocks count: the prefill worker recomputes everything
    options = LaunchOptions(prefill_args=("--no-prefix-caching",) if request.param.endswith("cache-only") else ())
    config = local_deployment(
        model=str(tiny_llama_dir), threads_per_worker=1, http_port=0, model_name="tiny", **topology[request.param]
    )
    with LocalCluster(config, options) as started:
        yield started


def post(cluster: LocalCluster, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://{cluster.http_address}{path}",
        data=json.dumps({"model": "tiny", **body}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())


def http_completion(cluster: LocalCluster, prompt: str) -> dict:
    return post(cluster, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "temperature": 0})["usage"]


def grpc_usage(cluster: LocalCluster, prompt: str) -> common_pb2.Usage:
    request = router_pb2.GenerateRequest(prompt=prompt, params=common_pb2.SamplingParams(max_tokens=3))
    with grpc.insecure_channel(cluster.router_address) as channel:
        return list(router_pb2_grpc.RouterStub(channel).Generate(request, timeout=120))[-1].usage


def test_repeated_prompt_reports_cached_tokens(cluster: LocalCluster) -> None:
    prompt = f"[{cluster.config.size('prefill')}] " + " ".join(f"word{i}" for i in range(40))  # > 3 blocks of tokens
    first = http_completion(cluster, prompt)
    assert first["prompt_tokens"] > 3 * BLOCK_SIZE
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    second = http_completion(cluster, prompt)
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert second["prompt_tokens"] == first["prompt_tokens"]
    # every full block but the one of the last prompt token (that one is always computed)
    assert cached == (first["prompt_tokens"] - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert cached > 0 and cached % BLOCK_SIZE == 0
    again = grpc_usage(cluster, prompt)  # the gRPC API carries the same field
    assert again.cached_tokens == cached and again.prompt_tokens == first["prompt_tokens"]
    fresh = grpc_usage(cluster, "something else entirely " * 3)
    assert fresh.cached_tokens == 0


def test_cache_salt_keeps_tenants_apart(cluster: LocalCluster) -> None:
    """Issue 29 row 8: a tenant cannot learn another's prompt from cached_tokens. Blocks are shared only
    within one cache_salt, through both phases (prefill and decode workers hash with the salt)."""
    secret = f"[{cluster.config.size('prefill')}] The PIN of the vault is 4711. " + " ".join(f"w{i}" for i in range(40))

    def cached(salt: str | None) -> int:
        body = {"prompt": secret, "max_tokens": 2, "temperature": 0, **({"cache_salt": salt} if salt else {})}
        return post(cluster, "/v1/completions", body)["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # the same prompt under another salt: nothing shared
    assert cached(None) == 0  # nor with the unsalted namespace
    assert cached("tenant-a") > 0  # within the salt it is shared as usual
    assert cached(None) > 0


@pytest.fixture(scope="module")
def hf(tiny_llama_dir: Path) -> tuple:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval(), AutoTokenizer.from_pretrained(tiny_llama_dir)


def hf_logprobs(hf: tuple, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf[0](torch.tensor([ids])).logits[0].float(), dim=-1)


PROMPT = "The river ran past the old mill, and the children"


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_completion_echo_logprobs_match_hf(cluster: LocalCluster, hf: tuple, max_tokens: int) -> None:
    answer = post(
        cluster,
        "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "temperature": 0.7,
            "seed": 5,
            "logprobs": 2,
            "echo": True,
            "ignore_eos": True,
        },
    )
    choice, usage = answer["choices"][0], answer["usage"]
    prompt_ids = hf[1](PROMPT).input_ids
    lp = choice["logprobs"]
    assert usage["prompt_tokens"] == len(prompt_ids) and usage["completion_tokens"] == max_tokens
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(prompt_ids) + max_tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert choice["text"].startswith(PROMPT)
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    pieces = [hf[1].decode([t]) for t in prompt_ids]
    assert lp["tokens"][: len(prompt_ids)] == pieces
    # the generated ids: their pieces, checked against the text
    out_text = choice["text"][len(PROMPT) :]
    out_ids = hf[1](PROMPT + out_text, add_special_tokens=True).input_ids[len(prompt_ids) :] if max_tokens else []
    ref = hf_logprobs(hf, prompt_ids + out_ids)
    ids = prompt_ids + out_ids
    for i in range(1, len(ids)):
        assert abs(lp["token_logprobs"][i] - ref[i - 1, ids[i]].item()) < 1e-4, i
        top = torch.topk(ref[i - 1], 2)
        for token_id, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert abs(lp["top_logprobs"][i][hf[1].decode([token_id])] - value) < 1e-4


def test_chat_logprobs_and_grpc_field(cluster: LocalCluster, hf: tuple) -> None:
    answer = post(
        cluster,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 5,
            "logprobs": True,
            "top_logprobs": 3,
            "ignore_eos": True,
        },
    )
    content = answer["choices"][0]["logprobs"]["content"]
    assert len(content) == 5 and all(len(c["top_logprobs"]) == 3 for c in content)
    for c in content:  # greedy: the chosen token is the most likely one
        assert c["top_logprobs"][0]["logprob"] == pytest.approx(c["logprob"], abs=1e-6)
        assert c["bytes"] == list(c["token"].encode())
    request = router_pb2.GenerateRequest(
        prompt=PROMPT, params=common_pb2.SamplingParams(max_tokens=3, ignore_eos=True, logprobs=1, prompt_logprobs=0)
    )
    with grpc.insecure_channel(cluster.router_address) as channel:
        responses = list(router_pb2_grpc.RouterStub(channel).Generate(request, timeout=120))
    prompt_ids = hf[1](PROMPT).input_ids
    prompt_entries = [e for r in responses for e in r.prompt_logprobs]
    out_entries = [e for r in responses for e in r.logprobs]
    out_ids = [t for r in responses for t in r.token_ids]
    assert [e.token_id for e in prompt_entries] == prompt_ids and not prompt_entries[0].HasField("logprob")
    assert [e.token_id for e in out_entries] == out_ids and len(out_ids) == 3
    ref = hf_logprobs(hf, prompt_ids + out_ids)
    got = [e.logprob for e in prompt_entries[1:] + out_entries]
    want = [ref[i - 1, t].item() for i, t in enumerate(prompt_ids + out_ids) if i > 0]
    assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < 1e-4


def test_streamed_completion_logprobs(cluster: LocalCluster) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "logprobs": 1, "stream": True, "ignore_eos": True}
    request = urllib.request.Request(
        f"http://{cluster.http_address}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        events = [line[6:] for line in answer.read().decode().splitlines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    tokens = [t for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get("tokens", [])]
    assert len(tokens) == 4


def test_logprob_prompts_are_prefilled_on_the_prefill_pool(cluster: LocalCluster, hf: tuple) -> None:
    """A request asking for logprobs (first token and prompt) is disaggregated like any other: the
    prefill worker computes its prompt, and the logprobs it ships with the K/V reach the client
    (checked against HF above); the decode worker computes none of the prompt."""
    by_role = {w.role: w for w in cluster.workers}
    if "prefill" not in by_role:
        pytest.skip("colocated: one worker prefills and decodes everything (nothing to split)")
    prompt = f"[{cluster.config.kv.backend}] " + " ".join(f"token{i}" for i in range(60))
    before = {role: worker_info(by_role[role].address, role).prefill_tokens_computed for role in by_role}
    answer = post(
        cluster,
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 3, "logprobs": 3, "echo": True, "ignore_eos": True, "temperature": 0},
    )
    after = {role: worker_info(by_role[role].address, role).prefill_tokens_computed for role in by_role}
    prompt_ids = hf[1](prompt).input_ids
    lp = answer["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(prompt_ids) + 3 and lp["token_logprobs"][0] is None
    ref = hf_logprobs(hf, prompt_ids)
    got = lp["token_logprobs"][1 : len(prompt_ids)]
    want = [ref[i - 1, t].item() for i, t in enumerate(prompt_ids) if i > 0]
    assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < 1e-4
    assert after["prefill"] - before["prefill"] >= len(prompt_ids)  # prefill worker: the whole prompt
    assert after["decode"] == before["decode"]  # decode worker: none of it
