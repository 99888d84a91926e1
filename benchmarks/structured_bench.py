"""Constrained decoding's cost: output tok/s of the engine (default model, this process) with a
`json_schema` constraint on every request against the same requests unconstrained, alternating runs,
each measured in the same process on the same machine.

    python benchmarks/structured_bench.py [--requests 16] [--max-tokens 64] [--repeats 3]

The schema asks for a long answer (a list of 64 short strings), so constrained requests run to
max_tokens like the unconstrained ones (EOS ignored there; the script checks the counts match);
tok/s counts every output token over the wall time of the whole batch. The goal (issue: the
request surface) is constrained / plain >= 0.9."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from peer_vllm import cpu_description  # benchmarks/ is the script's own folder

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_fetch import resolve_model
from pdserve.engine.model_loader import load_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.tokenization import encode_chat

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "minItems": 64, "maxItems": 64, "items": {"type": "string", "maxLength": 24}}
    },
    "required": ["items"],
    "additionalProperties": False,
}


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    return time.perf_counter() - start, sum(len(o) for o in outputs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    print(cpu_description())
    loaded = load_model(resolve_model(args.model))
    engine = LLMEngine(loaded, EngineConfig(num_blocks=2048))
    prompts = [
        encode_chat(loaded.tokenizer, [("user", f"List {i + 5} things you find in a kitchen, as JSON.")])
        for i in range(args.requests)
    ]
    plain = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=1, ignore_eos=True)
    constrained = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=0.8,
        seed=1,
        ignore_eos=True,
        structured=("json_schema", json.dumps(SCHEMA)),
    )
    _run(engine, prompts[:2], constrained)  # warm-up: compiles the grammar, loads llguidance
    rates: dict[str, list[float]] = {"plain": [], "constrained": []}
    tokens: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, params in (("plain", plain), ("constrained", constrained)):
            seconds, count = _run(engine, prompts, params)
            rates[name].append(count / seconds)
            tokens[name] = count
    assert tokens["plain"] == tokens["constrained"], f"runs of different lengths: {tokens}"
    plain_rate, constrained_rate = statistics.median(rates["plain"]), statistics.median(rates["constrained"])
    print(f"plain        {plain_rate:7.1f} tok/s  ({tokens['plain']} tokens per run)  runs {rates['plain']}")
    print(
        f"constrained  {constrained_rate:7.1f} tok/s  ({tokens['constrained']} tokens per run)  "
        f"runs {rates['constrained']}"
    )
    print(f"constrained / plain: {constrained_rate / plain_rate:.3f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {"cpu": cpu_description(), "rates": rates, "tokens": tokens, "ratio": constrained_rate / plain_rate},
                out,
                indent=1,
            )


if __name__ == "__main__":
    main()
