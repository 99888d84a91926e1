"""Structured outputs: constrained decoding with llguidance (JSON Schema, JSON object, regex, choice,
Lark grammar), the way vLLM offers it.

- A request's constraint is `(kind, spec)` (`SamplingParams.structured`); `grammar_of` turns it into
  an llguidance grammar, compiled once per (kind, spec) and cached. JSON output is compact (no free
  whitespace between tokens: a free-whitespace grammar lets a model pad forever).
- Each constrained sequence holds a `Constraint` (an `LLMatcher`). The engine starts filling the
  token bitmasks of a pass's constrained rows before its forward pass (`start_masks`: llguidance's
  threads, without the GIL, so they overlap the model) and masks the logits with them before
  sampling (`apply_masks`, batched, on the logits' device); after sampling, the token is consumed;
  once the matcher is stopped the request is complete.
- State is derived from tokens only: a worker builds the matcher from the request and advances it
  by the output tokens it is given (`Constraint.advance`), so the prefill worker (which samples the
  first token), the decode worker, a failover and a live migration need no extra hand-off.
"""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from pdserve.failures import RequestInvalid
from pdserve.limits import MAX_STRUCTURED_CHARS

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = MAX_STRUCTURED_CHARS
_COMPACT = {"whitespace_flexible": False}  # llguidance's JSON option: no free whitespace


class StructuredOutputError(RequestInvalid):
    """A constraint that cannot be compiled (bad schema, regex or grammar); the message names it."""


def _llg() -> Any:  # noqa: ANN401 - the llguidance module
    import llguidance

    return llguidance


@lru_cache(maxsize=512)
def grammar_of(kind: str, spec: str) -> str:
    """The llguidance grammar of a constraint (cached); StructuredOutputError when it is malformed."""
    matcher = _llg().LLMatcher
    if kind not in KINDS:
        raise StructuredOutputError(f"structured output: unknown kind {kind!r}; one of {', '.join(KINDS)}")
    if len(spec) > MAX_SPEC_CHARS:
        raise StructuredOutputError(f"structured output: {kind} longer than {MAX_SPEC_CHARS} characters")
    if kind in ("json_schema", "json_object"):
        try:
            schema = json.loads(spec) if kind == "json_schema" else {"type": "object"}
        except json.JSONDecodeError as exc:
            raise StructuredOutputError(f"structured output: json_schema is not valid JSON: {exc}") from None
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": {**_COMPACT, **schema.get("x-guidance", {})}}
        elif schema is not True:
            raise StructuredOutputError("structured output: json_schema must be a JSON object")
        return str(matcher.grammar_from_json_schema(json.dumps(schema)))
    if kind == "regex":
        return str(matcher.grammar_from_regex(spec))
    if kind == "choice":
        try:
            choices = json.loads(spec)
        except json.JSONDecodeError:
            choices = None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise StructuredOutputError("structured output: choice must be a non-empty list of non-empty strings")
        return str(matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices)))
    return str(matcher.grammar_from_lark(spec))


def tokenizer_of(loaded: Any) -> Any:  # noqa: ANN401 - an llguidance LLTokenizer
    """llguidance's view of the model's tokenizer (built once per loaded model, ~2 s)."""
    cached = getattr(loaded.tokenizer, "_pdserve_llg_tokenizer", None)
    if cached is None:
        import llguidance.hf

        eos = sorted(loaded.eos_token_ids) or None
        cached = llguidance.hf.from_tokenizer(loaded.tokenizer, n_vocab=int(loaded.config.vocab_size), eos_token=eos)
        loaded.tokenizer._pdserve_llg_tokenizer = cached
    return cached


def check(loaded: Any, kind: str, spec: str) -> None:  # noqa: ANN401
    """StructuredOutputError (naming the problem) unless the constraint compiles for this model."""
    grammar = grammar_of(kind, spec)
    is_error, messages = _llg().LLMatcher.validate_grammar_with_warnings(grammar, tokenizer_of(loaded))
    if is_error:
        raise StructuredOutputError(f"structured output: {kind}: {'; '.join(messages) or 'invalid'}")


class Constraint:
    """One sequence's matcher: which tokens may come next, and whether the output is complete."""

    def __init__(self, loaded: Any, kind: str, spec: str) -> None:  # noqa: ANN401
        self._matcher = _llg().LLMatcher(tokenizer_of(loaded), grammar_of(kind, spec))
        if self._matcher.is_error():
            raise StructuredOutputError(f"structured output: {kind}: {self._matcher.get_error()}")

    def advance(self, token_ids: list[int]) -> None:
        """Consume tokens already generated (a resumed or migrated request's), in order."""
        for token in token_ids:
            self.consume(token)

    def consume(self, token_id: int) -> None:
        if not self._matcher.is_stopped():
            self._matcher.consume_token(token_id)

    @property
    def done(self) -> bool:
        """The output is complete: nothing more may follow (the matcher stopped)."""
        return bool(self._matcher.is_stopped())


@dataclass
class Masks:
    """Token bitmasks being filled in the background for the constrained rows of a pass."""

    rows: list[int]  # rows of the sampled logits that are constrained
    bitmask: torch.Tensor  # [len(rows), words] int32
    filled: Future


_pool: tuple[ThreadPoolExecutor, Any] | None = None  # (the thread that waits, llguidance's executor)


def _executors() -> tuple[ThreadPoolExecutor, Any]:  # noqa: ANN401
    global _pool
    if _pool is None:
        _pool = (ThreadPoolExecutor(1, thread_name_prefix="pdserve-grammar"), _llg().LLExecutor())
    return _pool


def start_masks(constraints: list[Constraint | None], vocab: int) -> Masks | None:
    """Start filling the bitmasks of the constrained rows (None when none is), on llguidance's own
    threads, which run without the GIL: the engine starts this before the forward pass, so the
    masks are computed while the model runs, as vLLM and SGLang overlap them."""
    slots = [(row, c) for row, c in enumerate(constraints) if c is not None]
    if not slots:
        return None
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask_par

    bitmask = allocate_token_bitmask(len(slots), vocab)
    pool, executor = _executors()
    matchers = [(constraint._matcher, slot) for slot, (_, constraint) in enumerate(slots)]
    return Masks(
        [row for row, _ in slots], bitmask, pool.submit(fill_next_token_bitmask_par, executor, matchers, bitmask)
    )


def finish_masks(masks: Masks) -> None:
    """Wait until the bitmasks are filled (the matchers are free to advance after this)."""
    masks.filled.result()


def apply_masks(logits: torch.Tensor, masks: Masks) -> None:
    """Mask, in place, the constrained rows of `logits` [B, V]: tokens their constraint forbids get -inf."""
    from llguidance.torch import apply_token_bitmask_inplace

    finish_masks(masks)
    masked = logits[masks.rows].float()
    apply_token_bitmask_inplace(masked, masks.bitmask.to(logits.device))
    logits[masks.rows] = masked.to(logits.dtype)


def apply(logits: torch.Tensor, constraints: list[Constraint | None]) -> None:
    """`start_masks` then `apply_masks` at once (no forward pass to overlap)."""
    masks = start_masks(constraints, logits.shape[-1])
    if masks is not None:
        apply_masks(logits, masks)
