"""Decides when a sequence ends and what text of it may be streamed yet.

Stop strings are matched on the detokenized output. Text that could be the start of a stop string
is held back (at most the longest stop string minus one character), so a stop string never reaches
the client (unless `include_stop_str_in_output`: then the text ends with it), and the streamed text
never has to be taken back.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.sampling_params import SamplingParams

FINISH_STOP = "stop"  # EOS or a stop token id
FINISH_LENGTH = "length"
FINISH_STOP_STRING = "stop_string"
FINISH_ABORT = "abort"
FINISH_ERROR = "error"


@dataclass
class StopChecker:
    params: SamplingParams
    eos_token_ids: frozenset[int]
    text: str = ""  # all output text so far (from the detokenizer)
    emitted: int = 0  # chars of `text` already streamed
    finish_reason: str | None = None

    def on_token(self, token_id: int, num_output_tokens: int, text_delta: str) -> str:
        """Account one sampled token and its text; return the text that may be streamed now."""
        self.text += text_delta
        if not self.params.ignore_eos and token_id in self.eos_token_ids:
            self.finish_reason = FINISH_STOP
        elif token_id in self.params.stop_token_ids:
            self.finish_reason = FINISH_STOP
        elif self._cut_at_stop_string():
            self.finish_reason = FINISH_STOP_STRING
        elif num_output_tokens >= self.params.max_tokens:
            self.finish_reason = FINISH_LENGTH
        return self._release()

    def on_flush(self, text_delta: str) -> str:
        """The detokenizer's held-back tail at the end of the sequence."""
        if self.finish_reason != FINISH_STOP_STRING:
            self.text += text_delta
            if self._cut_at_stop_string():
                self.finish_reason = FINISH_STOP_STRING
        return self._release(final=True)

    def _cut_at_stop_string(self) -> bool:
        # a stop string can only newly appear in the not-yet-emitted tail plus its overlap
        longest = max((len(s) for s in self.params.stop), default=0)
        start = max(0, self.emitted - longest)
        hits = [(i, len(s)) for s in self.params.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        first, length = min(hits, key=lambda hit: (hit[0], -hit[1]))  # the earliest; the longest there
        self.text = self.text[: first + (length if self.params.include_stop_str_in_output else 0)]
        return True

    def _release(self, final: bool = False) -> str:
        end = len(self.text)
        if not final and self.finish_reason is None and self.params.stop:
            end -= max(len(s) for s in self.params.stop) - 1
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
