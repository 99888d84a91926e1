"""One scheduler and block pool for every role: chunked prefill, the prefix cache and preemption
give the same tokens on a colocated engine, and a prefill engine (with a KV connector) runs the same
code, holding a finished prompt's blocks until its K/V are released."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kv_connector import KvConnector
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import LayerCallback
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence, SequenceStatus

PREFIX = list(range(10, 58))  # three full blocks of 16
PROMPTS = [PREFIX + [7, 8, 9], PREFIX + [60, 61], list(range(100, 170)), [5, 6]]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.mark.slow
def test_chunked_prefill_and_prefix_cache_give_the_same_tokens(tiny_llama, make_engine) -> None:  # noqa: ANN001
    expected = make_engine(tiny_llama).generate(PROMPTS, PARAMS)
    engine = make_engine(tiny_llama, prefill_chunk_tokens=16, prefix_caching=True)
    first = engine.generate(PROMPTS[:1], PARAMS)  # its full prompt blocks stay cached
    rest = engine.generate(PROMPTS[1:], PARAMS)
    assert first + rest == expected
    assert engine.pool.cache_hits >= 3  # the second prompt took the first one's prefix blocks
    assert engine.runner.num_prefill_tokens < sum(len(p) for p in PROMPTS)


def test_chunks_of_a_long_prompt_share_passes_with_decoding_sequences(tiny_llama, make_engine) -> None:  # noqa: ANN001
    engine = make_engine(tiny_llama, prefill_chunk_tokens=16)
    engine.add_request("short", [5, 6], PARAMS)
    engine.step()
    engine.add_request("long", list(range(100, 170)), PARAMS)
    shapes = []
    while engine.has_work:
        engine.step()
        if engine.last_pass is not None:
            shapes.append((engine.last_pass.num_decode, engine.last_pass.num_prefill_tokens))
    prefills = [(decode, new) for decode, new in shapes if new]
    assert prefills[0] == (1, 16) and all(decode == 1 and new <= 16 for decode, new in prefills)
    assert sum(new for _, new in prefills) == 70  # chunks of at most 16, fewer deeper in (test_chunk_cost.py)


@pytest.mark.slow
def test_preempting_prefilling_and_running_work_keeps_the_tokens(tiny_llama, make_engine) -> None:  # noqa: ANN001
    prompts = [PREFIX + [7, 8, 9], PREFIX + [60, 61], list(range(100, 140)), [5, 6]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = make_engine(tiny_llama).generate(prompts, params)
    tight = make_engine(tiny_llama, num_blocks=10, block_size=8, prefill_chunk_tokens=8, prefix_caching=True)
    assert tight.generate(prompts, params) == expected  # 80 token slots for about 240 tokens
    assert tight.scheduler.num_preemptions > 0


class RecordingConnector(KvConnector):
    def __init__(self) -> None:
        self.done: dict[str, tuple[Sequence, int]] = {}

    def layer_hook(self, completing: list[Sequence]) -> LayerCallback | None:
        return None

    def pass_failed(self, completing: list[Sequence], error: Exception) -> list[Sequence]:
        return []

    def prefill_done(self, seq: Sequence, first_token: int) -> None:
        self.done[seq.request_id] = (seq, first_token)


def test_a_prefill_engine_hands_off_and_holds_blocks_until_released(tiny_llama, make_engine) -> None:  # noqa: ANN001
    colocated = make_engine(tiny_llama)
    expected = colocated.generate(PROMPTS, SamplingParams(max_tokens=1))
    from pdserve.engine.config import EngineConfig

    connector = RecordingConnector()
    prefill = LLMEngine(
        tiny_llama, EngineConfig(num_blocks=64, prefill_chunk_tokens=16, prefix_caching=True), connector=connector
    )
    for i, prompt in enumerate(PROMPTS):
        prefill.add_request(str(i), prompt, SamplingParams(max_tokens=1))
    outputs = []
    while prefill.has_work:
        outputs += prefill.step()
    assert outputs == []  # every first token went to the connector
    assert [connector.done[str(i)][1] for i in range(len(PROMPTS))] == [e[0] for e in expected]
    held = sum(len(seq.block_table) for seq, _ in connector.done.values())
    assert prefill.pool.num_used > 0 and all(s.status is SequenceStatus.HANDED_OFF for s, _ in connector.done.values())
    assert held >= prefill.pool.num_used  # shared prefix blocks count once in the pool
    prefill.abort("0")  # an abort cannot free blocks a transfer may still read
    assert "0" in prefill.sequences
    for seq, _ in connector.done.values():
        prefill.release_handoff(seq)
        prefill.release_handoff(seq)  # idempotent
    assert not prefill.sequences
    prefill.pool.assert_all_free()
    assert torch.is_tensor(prefill.kv_cache.kv)
