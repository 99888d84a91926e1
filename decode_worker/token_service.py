"""DecodeWorker.Tokenize and Detokenize: the model's tokenizer for the HTTP API's /tokenize and
/detokenize (the router has no tokenizer of its own; it asks a serving worker).

Invariants: the ids are those Generate would compute for the same input (the same
`pdserve.tokenization` functions and chat template), so a client can count a prompt before sending
it; nothing is scheduled and nothing is held. Bad input is RequestInvalid; large input is tokenized
off the event loop, as Generate's.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pdserve.engine.model_loader import LoadedModel
from pdserve.failures import RequestInvalid
from pdserve.tokenization import chat_from_pb, encode_chat
from pdserve.v1 import worker_pb2

#: Inputs of more characters (or ids) are handled in a thread, not on the event loop.
INLINE_CHARS = 16 * 1024


def tokenize(loaded: LoadedModel, request: worker_pb2.TokenizeRequest) -> worker_pb2.TokenizeResponse:
    """The ids of a prompt or a chat, and the model's context length."""
    tokenizer = loaded.tokenizer
    kind = request.WhichOneof("input")
    if kind == "prompt":
        ids = list(tokenizer(request.prompt, add_special_tokens=request.add_special_tokens).input_ids)
    elif kind == "messages":
        messages, tools = chat_from_pb(request.messages)
        ids = encode_chat(tokenizer, messages, tools, add_generation_prompt=request.add_generation_prompt)
        if request.add_special_tokens:
            before, after = _special_affixes(tokenizer)
            ids = before + ids + after
    else:
        raise RequestInvalid("input: one of prompt or messages is required")
    return worker_pb2.TokenizeResponse(tokens=ids, max_model_len=loaded.max_model_len)


def _special_affixes(tokenizer: Any) -> tuple[list[int], list[int]]:  # noqa: ANN401 - a transformers tokenizer
    """The ids the tokenizer adds before and after a text with `add_special_tokens` (BOS, EOS ...)."""
    plain = list(tokenizer("a", add_special_tokens=False).input_ids)
    marked = list(tokenizer("a", add_special_tokens=True).input_ids)
    for start in range(len(marked) - len(plain) + 1):
        if marked[start : start + len(plain)] == plain:
            return marked[:start], marked[start + len(plain) :]
    return [], []


def detokenize(loaded: LoadedModel, request: worker_pb2.DetokenizeRequest) -> worker_pb2.DetokenizeResponse:
    """The text of token ids (special tokens kept); RequestInvalid for an id outside the vocabulary."""
    vocab = len(loaded.tokenizer)
    for i, token in enumerate(request.tokens):
        if not 0 <= token < vocab:
            raise RequestInvalid(f"tokens[{i}]: {token} is not a token id of this model (0 to {vocab - 1})")
    return worker_pb2.DetokenizeResponse(prompt=loaded.tokenizer.decode(list(request.tokens)))


def _size(request: worker_pb2.TokenizeRequest | worker_pb2.DetokenizeRequest) -> int:
    if isinstance(request, worker_pb2.DetokenizeRequest):
        return len(request.tokens)
    if request.WhichOneof("input") == "prompt":
        return len(request.prompt)
    return sum(len(m.content) + len(m.tool_calls_json) for m in request.messages.messages) + len(
        request.messages.tools_json
    )


async def answer_tokenize(loaded: LoadedModel, request: worker_pb2.TokenizeRequest) -> worker_pb2.TokenizeResponse:
    if _size(request) <= INLINE_CHARS:
        return tokenize(loaded, request)
    return await asyncio.to_thread(tokenize, loaded, request)


async def answer_detokenize(
    loaded: LoadedModel, request: worker_pb2.DetokenizeRequest
) -> worker_pb2.DetokenizeResponse:
    if _size(request) <= INLINE_CHARS:
        return detokenize(loaded, request)
    return await asyncio.to_thread(detokenize, loaded, request)
