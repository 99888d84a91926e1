"""Detokenization for every tokenizer family: a SentencePiece-style (Metaspace + byte fallback) BPE
tokenizer built here and the byte-level default. Streamed text, seeded with the prompt's last
tokens, equals a full decode's text after the prompt, multi-byte characters included, and the first
output token keeps its leading space. Also end to end through the engine with a tiny random Llama."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.model_loader import load_model
from pdserve.engine.sampling_params import SamplingParams

CORPUS = [
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "Winter in Jinan is clear and bright; the sun is warm.",
    "a cat sat on the mat with another cat",
    "café naïve über",
    "hello world, hello there, the world is wide",
] * 20
TEXTS = [
    ("The capital of France is", " Paris, and the café is naïve."),
    ("Winter in Jinan:", " 济南的冬天是响晴的。🙂 ok"),
    ("hello", " world 🙂🙂 über-cat"),
    ("a cat sat on the", " mat"),
]


def metaspace_tokenizer(byte_fallback: bool = True) -> PreTrainedTokenizerFast:
    """A Llama-2-style tokenizer: BPE over '▁'-marked words, unknown characters as <0xNN> byte tokens
    (`byte_fallback`; else as <unk>). Its alphabet has the multi-byte characters é, ï and ü."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=byte_fallback))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    model = json.loads(tok.to_str())["model"]
    vocab = dict(model["vocab"])
    for byte in range(256 if byte_fallback else 0):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok.model = models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=byte_fallback)
    tok.decoder = decoders.Sequence(
        [decoders.Metaspace(replacement="▁", prepend_scheme="first"), decoders.ByteFallback(), decoders.Fuse()]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def sp_tokenizer() -> PreTrainedTokenizerFast:
    return metaspace_tokenizer()


def stream(tokenizer, prompt_ids: list[int], output_ids: list[int]) -> list[str]:  # noqa: ANN001
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids)
    return [detok.add(t) for t in output_ids] + [detok.flush()]


def after_prompt(tokenizer, prompt_ids: list[int], output_ids: list[int]) -> str:  # noqa: ANN001
    """The full decode's text after the prompt's text."""

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    full, prompt = decode(prompt_ids + output_ids), decode(prompt_ids)
    assert full.startswith(prompt)
    return full[len(prompt) :]


def split(tokenizer, prompt: str, continuation: str) -> tuple[list[int], list[int]]:  # noqa: ANN001
    prompt_ids = tokenizer(prompt).input_ids
    all_ids = tokenizer(prompt + continuation).input_ids
    assert all_ids[: len(prompt_ids)] == prompt_ids, "the split must fall on a token boundary"
    return prompt_ids, all_ids[len(prompt_ids) :]


def test_metaspace_tokenizer_is_sentencepiece_like(sp_tokenizer: PreTrainedTokenizerFast) -> None:
    ids = sp_tokenizer("济 Paris", add_special_tokens=False).input_ids
    pieces = sp_tokenizer.convert_ids_to_tokens(ids)
    assert pieces[0] == "▁" and pieces[1].startswith("<0x")  # an unknown character falls back to bytes
    paris = sp_tokenizer(" Paris", add_special_tokens=False).input_ids
    # the failure this guards against: decoded alone, the first token loses its leading space
    assert not sp_tokenizer.decode(paris[-1:]).startswith(" ")


@pytest.mark.parametrize(("prompt", "continuation"), TEXTS)
@pytest.mark.parametrize("family", ["metaspace", "byte_level"])
def test_stream_equals_full_decode(
    family: str,
    prompt: str,
    continuation: str,
    sp_tokenizer,  # noqa: ANN001
    default_tokenizer,
) -> None:  # noqa: ANN001
    tokenizer = sp_tokenizer if family == "metaspace" else default_tokenizer
    prompt_ids, output_ids = split(tokenizer, prompt, continuation)
    deltas = stream(tokenizer, prompt_ids, output_ids)
    text = "".join(deltas)
    assert text == after_prompt(tokenizer, prompt_ids, output_ids) == continuation
    assert deltas[0].startswith(" ") or deltas[0] == ""  # first token's leading space kept
    assert text.startswith(" ") and "\ufffd" not in text
    if any(ord(c) > 0x7FF for c in continuation):
        assert "" in deltas[:-1]  # some token carried only part of a character: held back, never split


def test_unseeded_metaspace_loses_the_space(sp_tokenizer: PreTrainedTokenizerFast) -> None:
    prompt_ids, output_ids = split(sp_tokenizer, "The capital of France is", " Paris")
    unseeded = "".join(stream(sp_tokenizer, [], output_ids))
    assert unseeded == "Paris"  # what the detokenizer streamed before it took prompt context
    assert "".join(stream(sp_tokenizer, prompt_ids, output_ids)) == " Paris"


@pytest.fixture(scope="module")
def tiny_sp_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the Metaspace tokenizer, without byte fallback: a random model's
    stream of byte tokens is mostly invalid UTF-8, and ByteFallback turns a whole invalid run into
    U+FFFD (even its ASCII bytes), which no windowed decoder reproduces; valid multi-byte text
    through byte tokens is covered by `test_stream_equals_full_decode`."""
    sp_tokenizer = metaspace_tokenizer(byte_fallback=False)
    out = tmp_path_factory.mktemp("tiny-sp-llama")
    config = LlamaConfig(
        vocab_size=len(sp_tokenizer),
        bos_token_id=sp_tokenizer.bos_token_id,
        eos_token_id=sp_tokenizer.eos_token_id,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(7)
    LlamaForCausalLM(config).save_pretrained(out)
    sp_tokenizer.save_pretrained(out)
    return out


@pytest.mark.parametrize("family", ["metaspace", "byte_level"])
def test_engine_streams_full_decode(family: str, tiny_sp_llama_dir: Path, tiny_llama_dir: Path, make_engine) -> None:  # noqa: ANN001
    loaded = load_model(tiny_sp_llama_dir if family == "metaspace" else tiny_llama_dir)
    engine = make_engine(loaded)
    tokenizer = loaded.tokenizer
    # each prompt with 4 seeds: 16 streams, so some first token starts a word whatever the draws
    prompts = [tokenizer(p).input_ids for p, _ in TEXTS for _seed in range(4)]
    for i, prompt_ids in enumerate(prompts):
        engine.add_request(
            f"r{i}", prompt_ids, SamplingParams(max_tokens=40, temperature=1.0, seed=3 + i % 4, ignore_eos=True)
        )
    texts = {f"r{i}": "" for i in range(len(prompts))}
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work:
        for out in engine.step():
            texts[out.request_id] += out.text
            if out.token_id >= 0:
                outputs[out.request_id].append(out.token_id)
    first_spaces = 0
    for i, prompt_ids in enumerate(prompts):
        output_ids = outputs[f"r{i}"]
        assert len(output_ids) == 40
        first_spaces += tokenizer.convert_ids_to_tokens(output_ids[0]).startswith(("▁", "Ġ")) and texts[
            f"r{i}"
        ].startswith(" ")
        full = tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert texts[f"r{i}"] == full[len(prompt_text) :]
    if family == "metaspace":  # most of its vocabulary starts a word: some first token did, and kept its space
        assert first_spaces > 0
