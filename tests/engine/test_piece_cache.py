"""PieceCache (the router's tokenizing of repeated chat turns) gives exactly the tokenizer's ids: on
many generated texts and multi-turn chats, cold and warm, with special tokens, odd whitespace, digits,
punctuation and non-ASCII; a tokenizer it cannot prove exact for is tokenized whole; the bound holds."""

from __future__ import annotations

import json
import random

import pytest

from pdserve.tokenization import PieceCache, encode_chat, encode_text

ALPHABET = [
    "river",
    "mill",
    " boat",
    "Flour",
    "42",
    "3.14",
    "  ",
    "\n",
    "\n\n",
    "\t",
    " \n ",
    "'s",
    "'ll",
    "don't",
    "!?",
    "...",
    "—",
    "é",
    "数据",
    "🙂",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_start",
    "im_end|>",
    "<",
    "|",
    ">",
    "user",
    "assistant\n",
    " ",
    "x\ny",
    "a  b",
    "\r\n",
]


def _texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 60))) for _ in range(count)]


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_same_ids_as_the_tokenizer_on_many_texts(default_tokenizer, add_special_tokens: bool) -> None:  # noqa: ANN001
    pieces = PieceCache(default_tokenizer)
    assert pieces.exact  # SmolLM2's byte-level BPE qualifies: the cache is really used below
    texts = _texts(1, 600)
    for text in texts + texts:  # cold, then with every piece cached
        expected = list(default_tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
        assert pieces.encode(text, add_special_tokens=add_special_tokens) == expected, repr(text)
    assert pieces.hits > pieces.misses


def test_multi_turn_chats_match_whole_prompt_tokenizing(default_tokenizer) -> None:  # noqa: ANN001
    rng = random.Random(2)
    pieces = PieceCache(default_tokenizer)
    for _conversation in range(40):
        chat = [("system", rng.choice(["You are terse.", "Answer in French.\n\nBe kind."]))]
        for _turn in range(5):
            chat.append(("user", "".join(rng.choice(ALPHABET[:20]) for _ in range(rng.randint(1, 40)))))
            cached = encode_chat(default_tokenizer, chat, pieces=pieces)
            assert cached == encode_chat(default_tokenizer, chat)
            chat.append(("assistant", "".join(rng.choice(ALPHABET[:20]) for _ in range(rng.randint(1, 20)))))
    prompt = "<|im_start|>user\nhello  there<|im_end|>\n<|im_start|>assistant\n"
    assert encode_text(default_tokenizer, prompt, pieces) == encode_text(default_tokenizer, prompt)
    assert pieces.hits > 0


def test_a_tokenizer_it_cannot_prove_exact_is_tokenized_whole(default_tokenizer) -> None:  # noqa: ANN001
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(default_tokenizer.backend_tokenizer.to_str())
    for token in spec["added_tokens"]:
        token["lstrip"] = True  # "<|im_end|>" now swallows the whitespace before it
    from tokenizers import Tokenizer

    stripping = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))
    text = "hello  <|im_end|> world"
    pieces = PieceCache(stripping)
    assert not pieces.exact
    whole = list(stripping(text, add_special_tokens=False).input_ids)
    assert whole != list(default_tokenizer(text, add_special_tokens=False).input_ids)  # the strip matters
    assert pieces.encode(text, add_special_tokens=False) == whole


def test_bounded_by_characters(default_tokenizer) -> None:  # noqa: ANN001
    pieces = PieceCache(default_tokenizer, max_chars=100)
    for i in range(50):
        text = f"piece number {i} " * 3 + "<|im_end|>"
        assert pieces.encode(text, add_special_tokens=False) == list(
            default_tokenizer(text, add_special_tokens=False).input_ids
        )
    assert 0 < pieces._chars <= 100
