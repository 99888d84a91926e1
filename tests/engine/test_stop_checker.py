from __future__ import annotations

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.stop_checker import StopChecker

EOS = frozenset({2})


def _run(params: SamplingParams, pieces: list[tuple[int, str]]) -> tuple[str, str | None, int]:
    checker = StopChecker(params, EOS)
    out = ""
    for n, (token, text) in enumerate(pieces, start=1):
        out += checker.on_token(token, n, text)
        if checker.finish_reason:
            return out + checker.on_flush(""), checker.finish_reason, n
    return out + checker.on_flush(""), checker.finish_reason, len(pieces)


def test_stop_string_across_tokens_is_cut_and_never_streamed() -> None:
    params = SamplingParams(max_tokens=50, stop=("END",))
    checker = StopChecker(params, EOS)
    streamed = [checker.on_token(10, 1, "hello E"), checker.on_token(11, 2, "N"), checker.on_token(12, 3, "D more")]
    assert checker.finish_reason == "stop_string"
    assert "".join(streamed) == "hello " and "E" not in streamed[0]


def test_eos_length_and_stop_token() -> None:
    assert _run(SamplingParams(max_tokens=5), [(5, "a"), (2, ""), (6, "b")])[1:] == ("stop", 2)
    assert _run(SamplingParams(max_tokens=2), [(5, "a"), (6, "b"), (7, "c")]) == ("ab", "length", 2)
    assert _run(SamplingParams(max_tokens=9, stop_token_ids=(6,)), [(5, "a"), (6, "b")])[1:] == ("stop", 2)
    assert _run(SamplingParams(max_tokens=3, ignore_eos=True), [(2, "x"), (2, "y"), (2, "z")])[1] == "length"


def test_text_without_stop_is_released_in_full() -> None:
    text, reason, _ = _run(SamplingParams(max_tokens=3, stop=("zzz",)), [(5, "ab"), (6, "cz"), (7, "z")])
    assert text == "abczz" and reason == "length"


def test_include_stop_str_in_output_keeps_the_stop_string() -> None:
    pieces = [(10, "hello E"), (11, "N"), (12, "D more")]
    assert _run(SamplingParams(max_tokens=50, stop=("END",), include_stop_str_in_output=True), pieces)[:2] == (
        "hello END",
        "stop_string",
    )
    assert _run(SamplingParams(max_tokens=50, stop=("END",)), pieces)[:2] == ("hello ", "stop_string")
    # two stop strings at one place: the text ends with the longer one; the earlier place wins
    both = SamplingParams(max_tokens=50, stop=("ab", "abc", "x"), include_stop_str_in_output=True)
    assert _run(both, [(10, "1abcd")])[0] == "1abc"
    assert _run(both, [(10, "1x abc")])[0] == "1x"
