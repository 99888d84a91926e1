"""Per-request sampling and stopping parameters (validated: a bad value is a RequestInvalid naming its field)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.failures import RequestInvalid
from pdserve.limits import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
)

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGPROBS = 20  # OpenAI's bound on alternatives per position


#: Temperatures below this sample greedily (vLLM's threshold, `_SAMPLING_EPS`).
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy. top_k 0 and top_p 1.0 disable those filters.

    seed: with a seed, the token drawn at output position i depends only on (seed, i) and the
    logits, never on which other requests share the batch, so a request resumed elsewhere draws
    the same tokens.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # log-probability of each output token plus this many alternatives
    prompt_logprobs: int | None = None  # the same for each prompt token (the first has none)
    # penalties and biases (engine/sampler.py applies them; common.proto documents each)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)  # (token id, bias), sorted
    allowed_token_ids: tuple[int, ...] = field(default_factory=tuple)  # empty: every token
    bad_words: tuple[str, ...] = field(default_factory=tuple)
    # `bad_words` as token sequences: filled by the engine from its tokenizer (LLMEngine.new_sequence)
    bad_words_ids: tuple[tuple[int, ...], ...] = field(default_factory=tuple)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # honoured by slow tokenizers (as in vLLM)
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text
    cache_salt: str = ""  # prefix-cache namespace: blocks are shared only within one salt
    # structured output (engine/structured.py): (kind, spec), e.g. ("json_schema", "{...}"),
    # ("choice", '["yes", "no"]'); None: free text
    structured: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.max_tokens <= 1_000_000:
            raise RequestInvalid(f"max_tokens must be in [1, 1000000], got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise RequestInvalid(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestInvalid(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestInvalid(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise RequestInvalid(f"seed must be in [0, 2**63), got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise RequestInvalid(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        self._check_stops()
        self._check_penalties()

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise RequestInvalid(f"{name} must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise RequestInvalid(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestInvalid(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestInvalid(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise RequestInvalid(f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if token < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise RequestInvalid(f"logit_bias[{token}]: token ids >= 0 and biases in [-100, 100], got {bias}")
        if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS or any(t < 0 for t in self.allowed_token_ids):
            raise RequestInvalid(f"allowed_token_ids: at most {MAX_ALLOWED_TOKEN_IDS} ids, each >= 0")
        if len(self.bad_words) > MAX_BAD_WORDS or any(not 1 <= len(w) <= MAX_BAD_WORD_CHARS for w in self.bad_words):
            raise RequestInvalid(f"bad_words: at most {MAX_BAD_WORDS} words of 1..{MAX_BAD_WORD_CHARS} characters")

    @property
    def penalized(self) -> bool:
        """Whether any penalty, bias or min_tokens changes this request's logits."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.min_tokens
            or self.logit_bias
            or self.allowed_token_ids
            or self.bad_words_ids
        )

    def _check_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise RequestInvalid(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise RequestInvalid(f"stop: each string needs 1..{MAX_STOP_STRING_CHARS} chars, got {len(s)}")
        if any(t < 0 for t in self.stop_token_ids):
            raise RequestInvalid("stop_token_ids: token ids must be >= 0")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or below GREEDY_BELOW_TEMPERATURE: logits divided by such a temperature
        overflow to infinities and the draw to NaN, and the draw is the argmax in all but rounding."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE
