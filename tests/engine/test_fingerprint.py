"""The model fingerprint covers every weight and the tokenizer: a fine-tune that keeps the norms and
embeddings, or a changed tokenizer, is another model, and its K/V is refused between real workers."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import grpc
import pytest
import torch

from pdserve.engine import model_loader
from pdserve.engine.model_loader import fingerprint, load_model
from pdserve.transport import open_channel


def _sampled_fingerprint(model) -> str:  # noqa: ANN001
    """The scheme this replaced: config, dtype and a sample of norms and embeddings only (the folder's
    path, which it also took in through the config, left out: the same model may live anywhere)."""
    config = {k: v for k, v in model.config.to_dict().items() if k != "_name_or_path"}
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    h.update(str(model.dtype).encode())
    for name, tensor in model.state_dict().items():
        if "norm" in name or name.endswith("embed_tokens.weight"):
            h.update(name.encode())
            h.update(tensor.detach().flatten()[:4096].float().cpu().numpy().tobytes())
    return h.hexdigest()[:32]


@pytest.fixture(scope="module")
def merged_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a low-rank update merged into one attention projection (a LoRA merge):
    norms and embeddings are untouched."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama-merged")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    q = model.model.layers[1].self_attn.q_proj.weight
    with torch.no_grad():
        q += (
            0.05
            * torch.randn(q.shape[0], 2, generator=torch.Generator().manual_seed(7))
            @ torch.randn(2, q.shape[1], generator=torch.Generator().manual_seed(8))
        )
    model.save_pretrained(out)
    for f in tiny_llama_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(f, out / f.name)
    return out


def test_a_lora_merge_that_keeps_norms_and_embeddings_changes_the_fingerprint(
    tiny_llama_dir: Path, merged_dir: Path
) -> None:
    base, merged = load_model(tiny_llama_dir), load_model(merged_dir)
    assert _sampled_fingerprint(base.model) == _sampled_fingerprint(merged.model)  # the old scheme was fooled
    assert base.fingerprint != merged.fingerprint
    assert load_model(tiny_llama_dir).fingerprint == base.fingerprint  # stable across loads
    assert load_model(tiny_llama_dir, torch.bfloat16).fingerprint != base.fingerprint  # dtype is covered


def test_a_changed_tokenizer_changes_the_fingerprint(tiny_llama_dir: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(tiny_llama_dir, tmp_path / "m"))
    before = fingerprint(copy, torch.float32)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0]['content'] }}"
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    assert fingerprint(copy, torch.float32) != before


def test_file_digests_are_cached_by_size_and_mtime(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve.engine import model_fetch

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    copy = Path(shutil.copytree(tiny_llama_dir, tmp_path / "m"))
    hashed: list[str] = []
    real = model_fetch.file_sha256
    monkeypatch.setattr(model_fetch, "file_sha256", lambda p: hashed.append(Path(p).name) or real(p))
    first = fingerprint(copy, torch.float32)
    assert "model.safetensors" in hashed
    model_loader._DIGESTS.clear()  # a new process: only the cache folder remembers
    hashed.clear()
    assert fingerprint(copy, torch.float32) == first and hashed == []
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # a one-bit change of a weight, same size
    weights.write_bytes(bytes(data))
    assert fingerprint(copy, torch.float32) != first and hashed == ["model.safetensors"]


def test_a_folder_without_weight_files_hashes_the_state_dict(tiny_llama_dir: Path, tmp_path: Path) -> None:
    loaded = load_model(tiny_llama_dir)
    (tmp_path / "config.json").write_text("{}")
    a = fingerprint(tmp_path, torch.float32, loaded.model)
    with torch.no_grad():
        loaded.model.model.layers[0].mlp.down_proj.weight[0, 0] += 1
    assert fingerprint(tmp_path, torch.float32, loaded.model) != a
    with pytest.raises(ValueError, match="no weight files"):
        fingerprint(tmp_path, torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("kv_backend", ["grpc", "shm"])
def test_kv_from_a_worker_with_another_fingerprint_is_refused(
    kv_backend: str, tiny_llama_dir: Path, merged_dir: Path, tmp_path: Path
) -> None:
    """A real prefill worker process serving the merged model, a real decode worker process serving
    the base model: the decode worker refuses the K/V, naming the fingerprint, and frees everything."""
    from pdserve.cluster.local import child_env
    from pdserve.cluster.processes import ManagedProcess, stop_all
    from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

    def start(role: str, model: Path, *extra: str) -> ManagedProcess:
        argv = [
            sys.executable,
            "-m",
            f"{role}_worker",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--threads",
            "1",
            "--model",
            str(model),
            "--kv-cache-mb",
            "8",
            *extra,
        ]
        return ManagedProcess(role, argv, tmp_path / f"{role}.log", env=child_env())

    prefill = start("prefill", merged_dir)
    decode = start("decode", tiny_llama_dir, "--kv-backend", kv_backend)
    try:
        p_addr = str(prefill.wait_ready(120)["address"])
        d_addr = str(decode.wait_ready(120)["address"])
        from security_helpers import register_kv_targets

        register_kv_targets(p_addr, [d_addr])  # as a router would
        stub = worker_pb2_grpc.DecodeWorkerStub(open_channel(d_addr))
        with pytest.raises(grpc.RpcError) as err:
            list(
                stub.Generate(
                    worker_pb2.DecodeRequest(
                        request_id="mixed-models",
                        token_ids=common_pb2.TokenIds(ids=list(range(3, 40))),
                        prefill_address=p_addr,
                        params=common_pb2.SamplingParams(max_tokens=3),
                    ),
                    timeout=60,
                )
            )
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # the router would retry on another prefill worker
        assert "model_fingerprint" in err.value.details(), err.value.details()
        from e2e_helpers import wait_idle

        wait_idle([("decode", d_addr), ("prefill", p_addr)])
    finally:
        stop_all([prefill, decode], 10)
