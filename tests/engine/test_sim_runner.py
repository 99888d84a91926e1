"""The simulated engine: waits the profile's time / speedup, deterministic pseudo tokens, a real
LLMEngine around it, and KV hand-offs that take the modelled time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.kv_cache import KVCache
from pdserve.engine.model_runner import StepInput
from pdserve.engine.runners import build_runner
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sim_profile import DecodeCost, LinkCost, PrefillCost, Profile
from pdserve.engine.sim_runner import SimLoadedModel, SimRunner, load_sim_model
from pdserve.kv_transfer import KvSpec
from pdserve.kv_transfer.modelled import ModelledLinkSender, shipped_tokens

PROFILE = Profile(
    name="unit",
    model_name="tiny",
    kv_bytes_per_token=1000.0,
    prefill=PrefillCost(0.05, 0.001, 1e-6),
    decode=DecodeCost(0.02, 0.001, 1e-5),
    transfer={"shm": LinkCost(0.01, 1e6)},
)


@pytest.fixture(scope="module")
def sim_model(default_model_dir: Path) -> SimLoadedModel:
    return load_sim_model(default_model_dir, PROFILE, speedup=2.0)


class FakeClock:
    def __init__(self) -> None:
        self.now, self.slept = 0.0, []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_forward_waits_the_modelled_time_divided_by_the_speedup(sim_model: SimLoadedModel) -> None:
    kv = KVCache(sim_model.kv_shape(16), num_blocks=64)
    fake = FakeClock()
    runner = SimRunner(sim_model, kv, sleep=fake.sleep, clock=fake.clock)
    items = [StepInput([5] * 100, 0, list(range(7))), StepInput([9], 40, [10, 11, 12])]
    expected = PROFILE.pass_s([(100, 0)], 1, 41)
    logits = runner.forward(items)
    assert fake.slept == [pytest.approx(expected / 2.0)]
    assert runner.modelled_seconds == pytest.approx(expected)
    assert runner.num_forward_passes == 1 and runner.num_prefill_tokens == 100
    tokens = logits.argmax(dim=-1).tolist()
    assert tokens == [runner.next_token(i) for i in items]
    assert torch.isfinite(logits).sum().item() == len(items)  # one finite entry per row: any sampler picks it
    assert not set(tokens) & sim_model.eos_token_ids
    assert all(sim_model.tokenizer.decode([t]).strip().isalpha() for t in tokens)


def test_no_weights_and_a_placeholder_cache(sim_model: SimLoadedModel) -> None:
    shape = sim_model.kv_shape(16)
    assert shape.bytes_per_block == 16 * 4  # 4 bytes per token, whatever the model
    assert isinstance(build_runner(sim_model, KVCache(shape, 4)), SimRunner)
    assert sim_model.fingerprint.startswith("sim-")
    assert load_sim_model(sim_model.path, PROFILE).fingerprint == sim_model.fingerprint  # both roles agree


def test_engine_generates_deterministic_text_and_frees_every_block(make_engine, default_model_dir: Path) -> None:  # noqa: ANN001
    fast = Profile(
        name="fast",
        model_name="tiny",
        kv_bytes_per_token=1.0,
        prefill=PrefillCost(0.0, 0.0, 0.0),
        decode=DecodeCost(0.0, 0.0, 0.0),
        transfer={"shm": LinkCost(0.0, 1.0)},
    )
    loaded = load_sim_model(default_model_dir, fast)
    prompts = [[1, 2, 3], [7] * 40, [11, 12]]
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, top_p=0.5, top_k=5)
    first = make_engine(loaded, num_blocks=32).generate(prompts, greedy)
    again = make_engine(loaded, num_blocks=32).generate(prompts, sampled)
    assert first == again and all(len(out) == 12 for out in first)
    assert first[0] != first[1]  # tokens depend on the input
    text = loaded.tokenizer.decode(first[0])
    assert len(text.split()) >= 6


def test_speedup_must_be_positive(default_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="speedup"):
        load_sim_model(default_model_dir, PROFILE, speedup=0.0)


class RecordingSender:
    supports_layer_streaming = False

    def __init__(self) -> None:
        self.sent: list[KvSpec] = []

    def send(self, spec, kv, first_token_id, timeout_s):  # noqa: ANN001, ANN201
        self.sent.append(spec)
        return "ack"


def test_modelled_link_waits_for_the_shipped_tokens_only() -> None:
    inner, slept = RecordingSender(), []
    sender = ModelledLinkSender(
        inner, lambda spec: PROFILE.transfer_s("shm", shipped_tokens(spec)) / 4, sleep=slept.append
    )
    spec = KvSpec("r1", "sim-x", "float16", (1, 2, 3, 16, 1, 1), 16, 100, block_offset=4)  # 7 blocks, 4 held
    assert sender.send(spec, torch.zeros(spec.shape, dtype=torch.float16), 1, 5.0) == "ack"
    assert shipped_tokens(spec) == 100 - 64 and inner.sent == [spec]
    assert slept == [pytest.approx((0.01 + 36 * 1000 / 1e6) / 4)]
