"""--device / --dtype plumbing on the CPU: resolution of "auto", the flags of every launcher, a
bf16 engine end to end in this process, and refusal of K/V of another dtype or device."""

from __future__ import annotations

import argparse

import pytest
import torch

from pdserve.decode_worker.config import DecodeWorkerConfig
from pdserve.devices import check_device_name, worker_flags
from pdserve.engine.config import EngineConfig, resolve_device, resolve_dtype
from pdserve.engine.kv_cache import KVCache, host_empty, to_host
from pdserve.engine.model_loader import load_model
from pdserve.engine.model_runner import ModelRunner, StepInput
from pdserve.engine.sampler import sample
from pdserve.engine.sampling_params import SamplingParams


def test_auto_resolves_to_fp32_on_cpu_and_bf16_on_cuda() -> None:
    assert resolve_device("auto", cuda_count=0) == "cpu"
    assert resolve_device("auto", cuda_count=2) == "cuda"
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("auto", "cuda:1") == "bfloat16"
    assert resolve_dtype("float16", "cpu") == "float16"
    assert resolve_device("cuda:1", cuda_count=2) == "cuda:1"


@pytest.mark.parametrize(
    ("device", "count", "message"),
    [
        ("cuda", 0, "CUDA is not available"),
        ("cuda:2", 2, "only 2 CUDA"),
        ("gpu", 1, "device must be"),
        ("cuda:x", 1, "device must be"),
        ("CPU", 0, "device must be"),
    ],
)
def test_bad_devices_are_refused_by_name(device: str, count: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_device(device, cuda_count=count)


def test_engine_config_holds_the_resolved_pair() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    config = EngineConfig(device="auto", dtype="auto")
    assert config.device == expected
    assert config.dtype == ("bfloat16" if expected == "cuda" else "float32")
    assert EngineConfig().torch_dtype == torch.float32  # the library default stays fp32 on the CPU
    assert EngineConfig(dtype="bfloat16").torch_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be"):
        EngineConfig(dtype="int8")


def test_worker_flags_default_to_auto_and_reject_bad_names() -> None:
    ap = argparse.ArgumentParser()
    DecodeWorkerConfig.add_flags(ap)
    args = ap.parse_args([])
    assert (args.device, args.dtype) == ("auto", "auto")
    args = ap.parse_args(["--device", "cuda:1", "--dtype", "bfloat16"])
    assert (args.device, args.dtype) == ("cuda:1", "bfloat16")
    for bad in (["--device", "tpu"], ["--dtype", "int8"]):
        with pytest.raises(SystemExit):
            ap.parse_args(bad)
    assert worker_flags("cpu", "bfloat16") == ["--device", "cpu", "--dtype", "bfloat16"]
    with pytest.raises(ValueError):
        check_device_name("cuda:")


def test_serve_passes_device_and_dtype_to_every_worker() -> None:
    from pdserve.cluster.cli import build_parser, deployment_config
    from pdserve.cluster.launch import local_deployment
    from pdserve.cluster.local import local_worker_document

    args = build_parser().parse_args(["serve", "--prefill", "1", "--decode", "1", "--dtype", "bfloat16"])
    config = deployment_config(args)
    assert (config.model.device, config.model.dtype) == ("auto", "bfloat16")
    for role, worker_id in config.worker_names():
        document = local_worker_document(config, role, worker_id)
        assert (document["device"], document["dtype"]) == ("auto", "bfloat16")
    with pytest.raises(ValueError, match="device"):
        local_deployment(device="gpu0")


def test_ray_workers_get_the_same_flags() -> None:
    pytest.importorskip("ray")
    from pdserve.cluster.cli import build_parser, deployment_config
    from pdserve.cluster.deploy_config import worker_document
    from pdserve.cluster.ray_cluster import worker_resources

    args = build_parser().parse_args(["serve", "--ray", "--device", "cuda", "--gpus-per-worker", "1"])
    config = deployment_config(args)
    for role in ("prefill", "decode"):
        document = worker_document(config, role, f"{role}-0")
        assert (document["device"], document["dtype"]) == ("cuda", "auto")
        assert worker_resources(config, role) == {"GPU": 1.0}


@pytest.fixture(scope="module")
def tiny_bf16(tiny_llama_dir):  # noqa: ANN001, ANN201
    return load_model(tiny_llama_dir, torch.bfloat16, "cpu")


def test_bf16_engine_keeps_weights_kv_and_logits_in_place(tiny_bf16, make_engine) -> None:  # noqa: ANN001
    engine = make_engine(tiny_bf16, dtype="bfloat16")
    assert next(tiny_bf16.model.parameters()).dtype == torch.bfloat16
    assert engine.kv_cache.kv.dtype == torch.bfloat16 and engine.kv_cache.device.type == "cpu"
    prompts = [[5, 6, 7, 8, 9] * 7, [11, 12, 13]]
    together = engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    alone = [engine.generate([p], SamplingParams(max_tokens=6, ignore_eos=True))[0] for p in prompts]
    assert together == alone and all(len(o) == 6 for o in together)  # batching changes nothing in bf16 either
    blocks = engine.pool.allocate(1)
    try:
        logits = engine.runner.forward([StepInput([5, 6, 7], 0, blocks)])
        assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    finally:
        engine.pool.free(blocks)


def test_bf16_differs_from_fp32_only_by_rounding(tiny_llama_dir, tiny_bf16) -> None:  # noqa: ANN001
    fp32 = load_model(tiny_llama_dir)
    assert fp32.fingerprint != tiny_bf16.fingerprint  # K/V of one is never taken for the other's
    logits = {}
    for name, loaded in (("fp32", fp32), ("bf16", tiny_bf16)):
        cache = KVCache(loaded.kv_shape(16), 4)
        logits[name] = ModelRunner(loaded, cache).forward([StepInput(list(range(3, 40)), 0, [0, 1, 2])])
    assert not torch.equal(logits["fp32"], logits["bf16"])
    torch.testing.assert_close(logits["bf16"], logits["fp32"], atol=0.1, rtol=0.05)


def test_runner_refuses_a_cache_of_another_dtype(tiny_bf16) -> None:  # noqa: ANN001
    shape = tiny_bf16.kv_shape(16)
    fp32_cache = KVCache(type(shape)(**{**shape.__dict__, "dtype": torch.float32}), 4)
    with pytest.raises(ValueError, match="dtype: weights are torch.bfloat16"):
        ModelRunner(tiny_bf16, fp32_cache)
    meta_cache = KVCache(shape, 4, device="meta")
    with pytest.raises(ValueError, match="device: weights are on cpu"):
        ModelRunner(tiny_bf16, meta_cache)


def test_scatter_refuses_kv_of_another_dtype_and_copies_from_host(tiny_bf16) -> None:  # noqa: ANN001
    cache = KVCache(tiny_bf16.kv_shape(16), 8)
    payload = torch.randn(cache.gather([0, 1]).shape).to(torch.bfloat16)
    with pytest.raises(ValueError, match="dtype: shipped K/V is torch.float32"):
        cache.scatter([3, 5], payload.float())
    cache.scatter([3, 5], payload)
    assert torch.equal(cache.gather([3, 5]), payload)
    assert torch.count_nonzero(cache.gather([0, 1, 2, 4, 6, 7])) == 0  # only the named blocks were written


def test_host_staging_on_cpu_is_a_no_op() -> None:
    t = torch.arange(6.0)
    assert to_host(t) is t  # CPU tensors are not copied again
    staged = host_empty((2, 3), torch.bfloat16)
    assert staged.device.type == "cpu" and staged.dtype == torch.bfloat16
    assert staged.is_pinned() == torch.cuda.is_available()


def test_seeded_sampling_is_the_same_from_bf16_or_fp32_logits() -> None:
    logits = torch.randn(3, 50).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.9, seed=11), SamplingParams(), SamplingParams(temperature=1.2, seed=4)]
    steps = [0, 0, 7]
    assert sample(logits, params, steps) == sample(logits.float(), params, steps)
