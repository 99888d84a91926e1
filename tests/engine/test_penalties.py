"""Penalties, logit bias, min_tokens and min_p (engine/sampler.py): against transformers' logits
processors and OpenAI's formula, and greedy output against transformers' `generate`."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_loader import LoadedModel
from pdserve.engine.sampler import TokenHistory, apply_penalties, sample
from pdserve.engine.sampling_params import SamplingParams

VOCAB = 50


def _logits(rows: int) -> torch.Tensor:
    torch.manual_seed(3)
    return torch.randn(rows, VOCAB) * 3


def test_repetition_penalty_matches_transformers_over_prompt_and_output() -> None:
    logits = _logits(2)
    before = logits.clone()
    ids = [3, 7, 7, 11, 40, 2]  # prompt 3, 7, 7, 11; output 40, 2
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams()]
    out = apply_penalties(logits, params, [TokenHistory(ids, 2), None])
    want = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([ids]), logits[:1].clone())
    torch.testing.assert_close(out[:1], want)
    assert torch.equal(out[1], logits[1])  # an unpenalized row is left alone
    assert torch.equal(logits, before)  # the input (read again for log-probabilities) is unchanged


def test_presence_and_frequency_follow_openai_over_output_tokens_only() -> None:
    logits = _logits(1)
    ids = [5, 5, 9, 12, 12, 12, 9]  # prompt 5, 5, 9; output 12, 12, 12, 9
    out = apply_penalties(
        logits, [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)], [TokenHistory(ids, 4)]
    )
    want = logits[0].clone()
    for token, count in ((12, 3), (9, 1)):  # OpenAI: mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence
        want[token] -= count * 0.25 + 0.5
    torch.testing.assert_close(out[0], want)  # token 5 (prompt only) is not penalized


def test_logit_bias_and_min_tokens() -> None:
    logits = _logits(1)
    params = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(17,), logit_bias=((4, 2.5), (6, -100.0)))
    early = apply_penalties(logits, [params], [TokenHistory([1, 2, 3], 1)], eos_token_ids={0})
    assert early[0, 0] == early[0, 17] == float("-inf")  # EOS and stop ids banned before min_tokens
    torch.testing.assert_close(early[0, 4], logits[0, 4] + 2.5)
    torch.testing.assert_close(early[0, 6], logits[0, 6] - 100.0)
    late = apply_penalties(logits, [params], [TokenHistory([1, 2, 3], 2)], eos_token_ids={0})
    assert torch.isfinite(late).all()  # min_tokens reached: EOS may come
    ignoring = SamplingParams(max_tokens=8, min_tokens=2, ignore_eos=True)
    kept = apply_penalties(logits, [ignoring], [TokenHistory([1], 0)], eos_token_ids={0})
    assert torch.isfinite(kept).all()  # ignore_eos: EOS does not stop, so it is not banned


def test_greedy_takes_the_biased_argmax_and_min_p_drops_unlikely_tokens() -> None:
    logits = _logits(1)
    top = int(logits[0].argmax())
    banned = SamplingParams(logit_bias=((top, -100.0),))
    assert sample(logits, [banned], [0], [TokenHistory([1], 0)]) != [top]
    with pytest.raises(ValueError, match="histories"):
        sample(logits, [banned], [0])
    probs = torch.softmax(logits[0], dim=-1)
    allowed = set((probs >= 0.3 * probs.max()).nonzero().flatten().tolist())
    params = SamplingParams(temperature=1.0, min_p=0.3, seed=11)
    drawn = {sample(logits, [params], [step])[0] for step in range(200)}
    assert drawn <= allowed and len(drawn) > 1


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 2.5),
        ("min_p", 1.5),
        ("min_tokens", 17),
        ("logit_bias", ((3, 101.0),)),
        ("logit_bias", ((-1, 1.0),)),
    ],
)
def test_out_of_range_values_name_their_field(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(max_tokens=16, **{name: value})  # type: ignore[arg-type]


PROMPTS = ["The cat sat on the mat. The cat sat on the", "List the colours: red, green, blue, red, green,"]


@pytest.mark.parametrize(
    ("params", "hf"),
    [
        ({"repetition_penalty": 1.3}, {"repetition_penalty": 1.3}),
        ({"min_tokens": 12}, {"min_new_tokens": 12}),
    ],
)
def test_greedy_with_penalties_matches_generate(default_model: LoadedModel, params: dict, hf: dict) -> None:
    engine = LLMEngine(default_model, EngineConfig(num_blocks=256))
    reference = AutoModelForCausalLM.from_pretrained(default_model.path).eval()
    tok = default_model.tokenizer
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    got = engine.generate(ids, [SamplingParams(max_tokens=16, **params) for _ in ids])
    for prompt_ids, tokens in zip(ids, got, strict=True):
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([prompt_ids]), max_new_tokens=16, do_sample=False, pad_token_id=tok.eos_token_id, **hf
            )
        want = out[0, len(prompt_ids) :].tolist()
        while want and want[-1] == tok.eos_token_id and len(want) > len(tokens):
            want.pop()  # generate pads a finished row; the engine stops at EOS
        assert tokens == want[: len(tokens)] and len(tokens) == len(want)
    engine.pool.assert_all_free()


def test_logit_bias_banning_the_argmax_matches_generate(default_model: LoadedModel) -> None:
    engine = LLMEngine(default_model, EngineConfig(num_blocks=256))
    reference = AutoModelForCausalLM.from_pretrained(default_model.path).eval()
    ids = default_model.tokenizer(PROMPTS[0])["input_ids"]
    first = engine.generate([ids], [SamplingParams(max_tokens=1)])[0][0]
    got = engine.generate([ids], [SamplingParams(max_tokens=12, min_tokens=12, logit_bias=((first, -100.0),))])[0]
    assert first not in got
    with torch.no_grad():
        want = reference.generate(
            torch.tensor([ids]),
            max_new_tokens=12,
            min_new_tokens=12,
            do_sample=False,
            sequence_bias={(first,): -100.0},
            pad_token_id=0,
        )[0, len(ids) :].tolist()
    assert got == want


def test_allowed_token_ids_and_bad_words() -> None:
    logits = _logits(1)
    allowed = SamplingParams(allowed_token_ids=(4, 9, 30))
    out = apply_penalties(logits, [allowed], [TokenHistory([1], 0)])
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [4, 9, 30]
    assert sample(logits, [allowed], [0], [TokenHistory([1], 0)]) == [max((4, 9, 30), key=lambda t: logits[0, t])]
    words = SamplingParams(bad_words=("x",), bad_words_ids=((7,), (11, 12, 13)))
    plain = apply_penalties(logits, [words], [TokenHistory([1, 2, 11], 1)])  # output [11]: not the whole prefix
    assert plain[0, 7] == float("-inf") and torch.isfinite(plain[0, 13])
    after_prefix = apply_penalties(logits, [words], [TokenHistory([11, 12, 11, 12], 3)])  # output ends 11, 12
    assert after_prefix[0, 13] == float("-inf") and after_prefix[0, 7] == float("-inf")


def test_bad_words_and_skip_special_tokens_in_the_engine(default_model: LoadedModel) -> None:
    from pdserve.engine.llm_engine import bad_words_ids

    tok = default_model.tokenizer
    variants = bad_words_ids(tok, ("cat",))
    assert tuple(tok.encode("cat", add_special_tokens=False)) in variants
    assert tuple(tok.encode(" cat", add_special_tokens=False)) in variants
    engine = LLMEngine(default_model, EngineConfig(num_blocks=256))
    ids = tok(PROMPTS[0])["input_ids"]
    free = engine.generate([ids], [SamplingParams(max_tokens=8)])[0]
    banned = engine.generate([ids], [SamplingParams(max_tokens=8, bad_words=("cat", "mat"))])[0]
    forbidden = {w[0] for w in bad_words_ids(tok, ("cat", "mat")) if len(w) == 1}
    assert forbidden & set(free) and not forbidden & set(banned)  # the free run says cat or mat; the other never
    special = tok.convert_tokens_to_ids("<|im_end|>")
    texts = {}
    for skip in (True, False):
        params = SamplingParams(max_tokens=2, ignore_eos=True, allowed_token_ids=(special,), skip_special_tokens=skip)
        engine.add_request(f"special-{skip}", ids, params)
        outputs = []
        while engine.has_work:
            outputs += engine.step()
        texts[skip] = "".join(o.text for o in outputs)
    assert texts[True] == "" and texts[False] == "<|im_end|><|im_end|>"
    engine.pool.assert_all_free()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-40),
        SamplingParams(temperature=1e-40, seed=3),
        SamplingParams(temperature=1.0, top_p=1e-300, seed=5),
        SamplingParams(temperature=2e-6, top_k=3),
    ],
)
def test_extreme_temperatures_and_top_p_sample_the_argmax_instead_of_failing(params: SamplingParams) -> None:
    """A client's `temperature: 1e-40` once overflowed the logits to infinities, the draw to NaN,
    and `multinomial` raised on the prefill worker (issue: one client cannot hurt another)."""
    logits = _logits(2) * 10
    assert sample(logits, [params, params], [0, 1]) == logits.argmax(dim=-1).tolist()
