"""The thread governor (engine/thread_governor.py): its choices from pass times, and that moving
between thread counts never changes a token."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_loader import LoadedModel
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.thread_governor import ThreadGovernor


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _passes(governor: ThreadGovernor, n: int, times: dict[int, float], key: object = 32) -> list[int]:
    """Run n passes of `key` whose time on t threads is times[t]; the thread count of each."""
    counts = []
    for _ in range(n):
        threads = governor.threads_for(key)
        governor.record(key, threads, times[threads])
        counts.append(threads)
    return counts


def test_a_quiet_machine_keeps_every_thread_and_probes_ever_less_often() -> None:
    governor = ThreadGovernor(2, probe_every=16, max_probe_every=128)
    counts = _passes(governor, 1000, {2: 0.060, 1: 0.095})
    assert governor.current == 2 and governor.moves == 0
    probes = [i for i, c in enumerate(counts) if c == 1]
    assert probes[0] == 15  # the first probe, after probe_every passes
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] == 128  # each lost probe doubles the wait, up to the cap
    assert len(probes) < 20


def test_a_busy_neighbour_moves_it_to_one_thread_fewer_at_once_and_back_when_it_leaves() -> None:
    governor = ThreadGovernor(2)
    _passes(governor, 200, {2: 0.060, 1: 0.095})  # quiet: its probes back off
    assert governor.current == 2
    # a neighbour takes a core: the 2-thread pass slows 4x; the slowdown probes at once
    counts = _passes(governor, 12, {2: 0.260, 1: 0.110})
    assert governor.current == 1 and governor.moves == 1
    assert counts.index(1) <= 4  # no waiting for the backed-off probe schedule
    # while it stays, probes of two threads lose and the count stays
    _passes(governor, 300, {2: 0.260, 1: 0.110})
    assert governor.current == 1 and governor.moves == 1
    # it leaves: the next probe of two threads wins twice and the count goes back
    _passes(governor, 600, {2: 0.060, 1: 0.095})
    assert governor.current == 2 and governor.moves == 2


def test_passes_without_a_comparable_shape_teach_nothing() -> None:
    governor = ThreadGovernor(2, probe_every=1)
    assert _passes(governor, 50, {2: 0.5, 1: 0.01}, key=None) == [2] * 50
    assert governor.moves == 0


def test_one_thread_has_nothing_to_choose() -> None:
    with pytest.raises(ValueError, match="at least two threads"):
        ThreadGovernor(1)


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_work:
        for token in engine.step():
            if token.token_id >= 0:
                out[token.request_id].append(token.token_id)
    return out


def test_moving_between_thread_counts_changes_no_token(
    tiny_llama: LoadedModel,
    make_engine,
    two_threads: None,  # noqa: ANN001
) -> None:
    prompts = [[(7 * i + j) % 500 + 3 for j in range(5 + 3 * i)] for i in range(6)]
    fixed = make_engine(tiny_llama, adapt_threads=False)
    assert fixed.governor is None
    want = _run(fixed, prompts, 24)
    moving = make_engine(tiny_llama)
    assert moving.governor is not None  # the tiny model's linears give the same bits at 1 and 2 threads
    # every probe "wins" (margin 1000): the count moves every few decode passes
    moving.governor = ThreadGovernor(2, probe_every=1, margin=1000.0, wins_to_move=1)
    assert _run(moving, prompts, 24) == want
    assert moving.governor.moves >= 5


def test_no_governor_where_the_count_must_stay(
    tiny_llama: LoadedModel,
    make_engine,
    two_threads: None,
    monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
) -> None:
    assert make_engine(tiny_llama, deterministic=True).governor is None
    monkeypatch.setenv("PDSERVE_ADAPT_THREADS", "0")
    assert make_engine(tiny_llama).governor is None
    monkeypatch.delenv("PDSERVE_ADAPT_THREADS")
    torch.set_num_threads(1)
    assert make_engine(tiny_llama).governor is None
