"""The router's CPU per request for KV-aware routing: tokenizing the prompt, hashing its blocks and
looking it up in the KV index, at a given prompt length, with the index holding a given number of
workers' caches. Prints the CPU model and flags with the figures.

Three cases, each request a new one (nothing is measured on a prompt tokenized before):
- a plain prompt of --tokens tokens, new text each time (nothing to reuse);
- a chat follow-up turn: a history of about --tokens tokens (system prompt and earlier turns, sent
  before) plus a new user message, tokenized and hashed whole (as before PieceCache) ...
- ... and with the router's PieceCache and RecentChains (only the new turn is tokenized, and only
  the blocks past the history sent before are hashed).

    python benchmarks/kv_router_cost.py [--model DIR] [--tokens 2000] [--workers 8] [--repeat 200]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from typing import Any

from pdserve.model_cache import default_model_dir
from pdserve.router.kv_index import KvIndex, PromptKeys, RecentChains
from pdserve.tokenization import encode_chat
from pdserve.v1 import common_pb2, router_pb2


def cpu() -> str:
    model, flags = platform.processor(), set()
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    wanted = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model or 'unknown CPU'} (flags: {' '.join(wanted) or 'none of avx2/avx512/amx'})"


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count)) + ". "


WORDS = "river mill boat flour water salt yeast morning bank count bread kitchen warm".split()


def _measure(
    keys: PromptKeys, index: KvIndex, requests: list[router_pb2.GenerateRequest], block_size: int
) -> tuple[list[float], list[float], int]:
    """(tokenize + hash seconds, lookup seconds, tokens of the last prompt), per request."""
    tokenize, lookup, tokens = [], [], 0
    for request in requests:
        t0 = time.process_time()
        prompt_keys, tokens = keys.keys(request, block_size)
        t1 = time.process_time()
        index.overlap(prompt_keys)
        t2 = time.process_time()
        tokenize.append(t1 - t0)
        lookup.append(t2 - t1)
    return tokenize, lookup, tokens


def _chat_turns(
    rng: random.Random, tokenizer: Any, tokens: int, repeat: int
) -> tuple[list[router_pb2.GenerateRequest], list[router_pb2.GenerateRequest]]:
    """(the histories sent first, the follow-ups measured): `repeat` conversations of about `tokens`
    tokens, each follow-up its history plus a new user message of 64-256 words."""
    history = [("system", _words(rng, 600))]
    while len(encode_chat(tokenizer, history)) < tokens - 200:
        history += [("user", _words(rng, 150)), ("assistant", _words(rng, 100))]
    before, measured = [], []
    for i in range(repeat):
        chat = [(role, f"conversation {i}. {content}") for role, content in history]
        before.append(_chat_request(chat))
        measured.append(_chat_request(chat + [("user", _words(rng, rng.randint(64, 256)))]))
    return before, measured


def _chat_request(chat: list[tuple[str, str]]) -> router_pb2.GenerateRequest:
    messages = common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in chat])
    return router_pb2.GenerateRequest(messages=messages, params=common_pb2.SamplingParams(max_tokens=1))


def _report(name: str, tokenize: list[float], lookup: list[float], tokens: int) -> None:
    total = sorted(a + b for a, b in zip(tokenize, lookup, strict=True))
    print(
        f"{name} ({tokens} tokens): tokenize + hash {statistics.median(tokenize) * 1e3:.3f} ms, "
        f"index lookup {statistics.median(lookup) * 1e3:.3f} ms, total {statistics.median(total) * 1e3:.3f} ms "
        f"(p90 {total[int(0.9 * len(total))] * 1e3:.3f} ms)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(default_model_dir()))
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--blocks-per-worker", type=int, default=20000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    keys = PromptKeys.load(args.model)
    whole = PromptKeys(keys.tokenizer)
    whole.pieces = None  # tokenizes every prompt whole, as the router did before PieceCache ...
    whole.chains = RecentChains(max_prompts=0)  # ... and hashes every block (before RecentChains)
    rng = random.Random(0)
    prompts = []
    for i in range(args.repeat):
        text = f"prompt {i}. "
        while len(keys.tokenizer.encode(text, add_special_tokens=False)) < args.tokens:
            text += _words(rng, 50)
        prompts.append(router_pb2.GenerateRequest(prompt=text, params=common_pb2.SamplingParams(max_tokens=1)))
    before, follow_ups = _chat_turns(rng, keys.tokenizer, args.tokens, args.repeat)
    index = KvIndex()
    histories = [whole.keys(request, args.block_size)[0] for request in before + prompts]
    for w in range(args.workers):  # each worker caches random blocks, 1 in 8 chat histories and prompts
        held = [rng.getrandbits(64) for _ in range(args.blocks_per_worker)]
        index.replace(f"w{w}", held + [key for keys_ in histories[w :: args.workers] for key in keys_])
    print(f"CPU: {cpu()}")
    print(
        f"index: {len(index):,} entries over {args.workers} workers; blocks of {args.block_size}; "
        f"median of {args.repeat} requests each"
    )
    _report("plain prompt, new each time", *_measure(keys, index, prompts, args.block_size))
    _report("chat follow-up, tokenized and hashed whole", *_measure(whole, index, follow_ups, args.block_size))
    tokenize, lookup, tokens = [], [], 0
    for request, follow_up in zip(before, follow_ups, strict=True):  # its history was sent just before
        keys.keys(request, args.block_size)
        one_tokenize, one_lookup, tokens = _measure(keys, index, [follow_up], args.block_size)
        tokenize += one_tokenize
        lookup += one_lookup
        assert keys.keys(follow_up, args.block_size) == whole.keys(follow_up, args.block_size), (
            "PieceCache changed a prompt's keys"
        )
    _report("chat follow-up, PieceCache + RecentChains", tokenize, lookup, tokens)


if __name__ == "__main__":
    main()
