"""Prompt chunks beside decoding streams cost at most one plain chunk (`engine.chunk_cost`): a chunk
deep in a long prompt gets fewer tokens, the chunks of several prompts share one allowance, and the
tokens stay those of an unchunked run. A prompt with nobody decoding beside it keeps full chunks."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from sim_profiles import make_profile

from pdserve.capacity.simulator import Deployment, Timing, simulate
from pdserve.engine.chunk_cost import (
    ATTENTION_EFFICIENCY,
    attention_crossover,
    chunk_cost,
    largest_chunk,
    profile_crossover,
)
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sim_profile import Profile, load_profile

CHUNK = 32
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
STREAM = SamplingParams(max_tokens=200, ignore_eos=True)  # outlasts every prefill here


@pytest.mark.parametrize("cached", [0, 1, 100, 2048, 100_000])
@pytest.mark.parametrize("allowance", [0.5, 1.0, 17.0, 661.3, 5000.0])
def test_largest_chunk_is_the_most_that_fits(cached: int, allowance: float) -> None:
    n = largest_chunk(cached, allowance, 1536.0)
    assert n >= 0
    assert n == 0 or chunk_cost(n, cached, 1536.0) <= allowance
    assert chunk_cost(n + 1, cached, 1536.0) > allowance


def test_a_plain_chunk_fits_its_own_allowance_exactly() -> None:
    for chunk in (1, 16, 512, 4096):
        for crossover in (1536.0, math.inf):
            assert largest_chunk(0, chunk_cost(chunk, 0, crossover), crossover) == chunk
    assert largest_chunk(10_000, 512.0, math.inf) == 512  # free attention: context costs nothing


def test_the_crossover_of_a_sim_model_is_its_profiles_and_a_real_ones_follows_its_shapes(tiny_llama) -> None:  # noqa: ANN001
    profile = load_profile("capacity/profiles/cpu-smollm2-135m.json")
    sim = SimpleNamespace(model=SimpleNamespace(profile=profile))
    assert attention_crossover(sim) == pytest.approx(profile.prefill.b / profile.prefill.c)
    c = tiny_llama.config
    wider = SimpleNamespace(
        model=SimpleNamespace(),
        config=SimpleNamespace(
            hidden_size=c.hidden_size,
            num_attention_heads=c.num_attention_heads,
            head_dim=None,
            num_key_value_heads=c.num_key_value_heads,
            intermediate_size=4 * c.intermediate_size,
        ),
    )
    assert attention_crossover(wider) > attention_crossover(tiny_llama) > 0  # bigger dense layers: later
    assert ATTENTION_EFFICIENCY < 1


def _run(engine, tokens: dict[str, list[int]]) -> list[list[tuple[int, int]]]:  # noqa: ANN001
    """Step until the engine is idle; return (new, cached) of every prompt chunk of each pass that
    ran one, and collect every request's tokens in `tokens`."""
    shapes = []
    while engine.has_work:
        for out in engine.step():
            assert out.error is None
            if out.token_id >= 0:
                tokens.setdefault(out.request_id, []).append(out.token_id)
        chunks = [
            (len(i.token_ids), i.seq.num_cached - len(i.token_ids)) for i in engine.last_pass.items if i.is_prefill
        ]
        if chunks:
            shapes.append(chunks)
    return shapes


def _with_a_stream(engine) -> None:  # noqa: ANN001
    engine.add_request("stream", [5, 6], STREAM)
    engine.step()  # prefilled: decoding from now on


def test_chunks_beside_a_stream_shrink_as_their_context_grows(tiny_llama, make_engine) -> None:  # noqa: ANN001
    engine = make_engine(tiny_llama, prefill_chunk_tokens=CHUNK)
    crossover = engine.scheduler.attention_crossover
    assert math.isfinite(crossover)
    allowance = chunk_cost(CHUNK, 0, crossover)
    _with_a_stream(engine)
    prompt = [100 + i % 200 for i in range(300)]
    engine.add_request("long", prompt, PARAMS)
    tokens: dict[str, list[int]] = {}
    chunks = [pass_[0] for pass_ in _run(engine, tokens)]
    assert sum(new for new, _ in chunks) == len(prompt)
    assert chunks[0] == (CHUNK, 0)
    assert all(chunk_cost(new, cached, crossover) <= allowance for new, cached in chunks)
    assert chunks[-2][0] < CHUNK  # deep in the prompt, fewer tokens per pass
    assert all(b[0] <= a[0] for a, b in zip(chunks, chunks[1:-1], strict=False))
    assert tokens["long"] == make_engine(tiny_llama).generate([prompt], PARAMS)[0]  # as one unchunked pass

    alone = make_engine(tiny_llama, prefill_chunk_tokens=CHUNK)
    alone.add_request("long", prompt, PARAMS)
    assert [pass_[0][0] for pass_ in _run(alone, {})][:-1] == [CHUNK] * (len(prompt) // CHUNK)


def test_prompts_beside_a_stream_share_one_allowance(tiny_llama, make_engine) -> None:  # noqa: ANN001
    engine = make_engine(tiny_llama, prefill_chunk_tokens=CHUNK)
    crossover = engine.scheduler.attention_crossover
    _with_a_stream(engine)
    for n in range(4):
        engine.add_request(f"long{n}", [100 + n + i % 150 for i in range(120)], PARAMS)
    shapes = _run(engine, {})
    assert all(
        sum(chunk_cost(new, cached, crossover) for new, cached in pass_) <= chunk_cost(CHUNK, 0, crossover)
        for pass_ in shapes
    )
    assert sum(new for pass_ in shapes for new, _ in pass_) == 4 * 120
    assert max(len(pass_) for pass_ in shapes) >= 2  # a prompt's short last chunk shares its pass


def test_the_capacity_simulator_chunks_a_prompt_beside_a_stream_as_the_scheduler_does(
    tiny_llama, make_engine, monkeypatch: pytest.MonkeyPatch
) -> None:  # noqa: ANN001
    """The same prompt, chunk size and K (the profile's b / c) beside one decoding stream: the capacity
    simulator's colocated worker plans the very chunks (new, cached) the real scheduler runs."""
    profile = make_profile(prefill=(0.001, 1e-4, 1e-4 / 120), decode=(0.001, 1e-4, 0.0), prefill_chunk_tokens=CHUNK)
    crossover = profile_crossover(profile)
    assert crossover == pytest.approx(120.0)
    prompt = [100 + i % 200 for i in range(300)]

    engine = make_engine(
        tiny_llama, prefill_chunk_tokens=CHUNK, max_num_batched_tokens=profile.engine.max_batched_tokens
    )
    engine.scheduler.attention_crossover = crossover
    _with_a_stream(engine)
    engine.add_request("long", prompt, PARAMS)
    real = _run(engine, {})

    passes: list[list[tuple[int, int]]] = []
    pass_s = Profile.pass_s

    def recorded(self: Profile, items, batch: int, context: int) -> float:  # noqa: ANN001
        if items:
            passes.append(list(items))
        return pass_s(self, items, batch, context)

    monkeypatch.setattr(Profile, "pass_s", recorded)
    # the stream first (2 prompt tokens, decoding long after), the prompt during the stream's prefill
    simulate(
        Deployment(colocated=1),
        [0.0, 1e-9],
        [2, len(prompt)],
        [STREAM.max_tokens, PARAMS.max_tokens],
        Timing(prefill=profile, decode=profile),
    )
    assert passes[0] == [(2, 0)]  # the stream's prefill, alone
    assert passes[1:] == real
    assert len(real) > len(prompt) // CHUNK + 1  # the chunks did shrink beside the stream
