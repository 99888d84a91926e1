"""The engine's step trace (engine.trace) and detokenization time, in one process on tiny models."""

from __future__ import annotations

from pdserve.engine.llm_engine import TokenOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.engine.trace import DecodeStepEvent, DetokenizeHoldEvent, PrefillPassEvent, token_bytes

PROMPT = "济南的冬"


def _run(engine, request_id: str = "r") -> list[TokenOutput]:  # noqa: ANN001
    outputs = []
    while engine.has_work:
        outputs += [out for out in engine.step() if out.request_id == request_id]
    return outputs


def test_one_prefill_pass_then_one_decode_step_per_token_kv_growing_by_one(tiny_model, make_engine) -> None:  # noqa: ANN001
    engine = make_engine(tiny_model)
    prompt = tiny_model.tokenizer(PROMPT).input_ids
    engine.add_request("r", prompt, SamplingParams(max_tokens=6, ignore_eos=True), trace=True)
    outputs = _run(engine)
    events = [e for out in outputs for e in out.trace]
    passes = [e for e in events if isinstance(e, PrefillPassEvent)]
    steps = [e for e in events if isinstance(e, DecodeStepEvent)]
    assert passes == [PrefillPassEvent(len(prompt), 0, len(prompt), passes[0].time_s, outputs[0].token_id)]
    assert passes[0].time_s > 0
    assert [s.token_id for s in steps] == [out.token_id for out in outputs[1:]]
    assert [s.kv_len for s in steps] == list(range(len(prompt) + 1, len(prompt) + 6))
    assert all(s.itl_s > 0 for s in steps)
    assert isinstance(outputs[0].trace[0], PrefillPassEvent)  # the pass comes with the first token
    assert 0 < outputs[0].detokenize_s <= outputs[-1].detokenize_s
    assert outputs[-1].prefill_s > 0 and outputs[-1].queue_s >= 0  # prefilled here: measured on the last output


def test_chunked_prefill_traces_every_chunk_contiguously(tiny_model, make_engine) -> None:  # noqa: ANN001
    engine = make_engine(tiny_model, prefill_chunk_tokens=8)
    prompt = tiny_model.tokenizer("the river and the old mill " * 4).input_ids
    engine.add_request("r", prompt, SamplingParams(max_tokens=2, ignore_eos=True), trace=True)
    passes = [e for out in _run(engine) for e in out.trace if isinstance(e, PrefillPassEvent)]
    assert len(passes) == -(-len(prompt) // 8) > 1
    assert [p.kv_len_before for p in passes] == [p.kv_len_after - p.num_tokens for p in passes]
    assert [p.kv_len_after for p in passes[:-1]] == [p.kv_len_before for p in passes[1:]]
    assert passes[0].kv_len_before == 0 and passes[-1].kv_len_after == len(prompt)
    assert [p.first_token_id is not None for p in passes] == [False] * (len(passes) - 1) + [True]


def test_untraced_requests_carry_no_events(tiny_model, make_engine) -> None:  # noqa: ANN001
    engine = make_engine(tiny_model)
    seq = engine.add_request("r", tiny_model.tokenizer(PROMPT).input_ids, SamplingParams(max_tokens=3))
    assert seq.trace is None
    assert all(out.trace == () for out in _run(engine))


def test_detokenization_holds_name_the_bytes_of_a_split_character(tiny_model) -> None:  # noqa: ANN001
    tokenizer = tiny_model.tokenizer
    ids = tokenizer(PROMPT).input_ids  # byte-level BPE: 济, 南 and 冬 take two tokens each
    seq = Sequence.create("r", [1], SamplingParams(max_tokens=50), tokenizer, frozenset(), trace=True)
    texts = [seq.append_token(t) for t in ids]
    holds = [e for e in seq.take_trace() if isinstance(e, DetokenizeHoldEvent)]
    assert "".join(texts) == PROMPT
    pieces = token_bytes(tokenizer, ids)
    assert b"".join(pieces) == PROMPT.encode()
    held = [b"".join(token_bytes(tokenizer, h.held_ids)) for h in holds]
    assert held == [c.encode()[: len(pieces[i])] for c, i in (("济", 0), ("南", 2), ("冬", 5))]
    assert [texts[i] for i, t in enumerate(ids) if t in {h.token_id for h in holds}] == ["", "", ""]
    assert seq.take_trace() == ()  # taken once
    assert seq.detokenize_s > 0
