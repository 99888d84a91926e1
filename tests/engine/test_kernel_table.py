"""One linear-kernel table per deployment (engine/kernel_table.py): a factory given a table follows it
instead of its own timing, refuses (and says so) a table timed on another CPU, and the table is timed
once per machine, model shape, dtype and thread count (cached)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdserve.cluster.kernel_tables import with_kernel_table
from pdserve.cluster.launch import local_deployment
from pdserve.engine.fast_forward import LinearFactory
from pdserve.engine.kernel_table import KernelTable, cache_path, cpu_identity, ensure_table, linear_shapes

CONFIG = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "vocab_size": 320,
}


def _table(
    factory: LinearFactory, k: int, n: int, bands: tuple[tuple[str, int], ...], cpu: str | None = None
) -> KernelTable:
    return KernelTable(cpu=cpu or cpu_identity(), threads=1, dtype="float32", entries={factory.entry_key(k, n): bands})


def test_a_factory_follows_the_deployment_table_instead_of_timing() -> None:
    probe = LinearFactory(torch.float32, torch.device("cpu"), mode="auto")
    weight = torch.randn(48, 64)
    if not probe.column_major:
        weight = weight.contiguous()
    # a choice no timing would make on purpose: the slowest-looking split, to prove it is followed
    bands = (("plain", 1), (probe.kernels[0], 3)) if probe.kernels[0] != "plain" else (("plain", 1),)
    factory = LinearFactory(torch.float32, torch.device("cpu"), mode="auto", table=_table(probe, 64, 48, bands))
    linear = factory(weight)
    assert linear.bands == bands and factory.off_table == []
    assert factory.describe_use().startswith("deployment table ")
    x = torch.randn(5, 64)
    torch.testing.assert_close(linear(x), x @ weight.t(), rtol=1e-5, atol=1e-5)


def test_a_shape_missing_from_the_table_is_timed_and_said() -> None:
    probe = LinearFactory(torch.float32, torch.device("cpu"), mode="auto")
    factory = LinearFactory(
        torch.float32, torch.device("cpu"), mode="auto", table=_table(probe, 64, 48, (("plain", 1),))
    )
    factory(torch.randn(40, 64))  # another shape
    assert factory.off_table == [(64, 40)]
    assert "own timing for 1 shapes (64x40 is not in it)" in factory.describe_use()


def test_a_table_timed_on_another_cpu_is_refused_and_the_worker_says_why() -> None:
    probe = LinearFactory(torch.float32, torch.device("cpu"), mode="auto")
    table = _table(probe, 64, 48, (("plain", 1),), cpu="Some Other CPU|avx2|torch 0")
    factory = LinearFactory(torch.float32, torch.device("cpu"), mode="auto", table=table)
    assert factory.table is None
    assert factory.describe_use().startswith("own timing (this CPU (") and "Some Other CPU" in factory.describe_use()


def test_a_table_of_another_dtype_is_refused() -> None:
    probe = LinearFactory(torch.float32, torch.device("cpu"), mode="auto")
    table = KernelTable(
        cpu=cpu_identity(), threads=1, dtype="bfloat16", entries={probe.entry_key(64, 48): (("plain", 1),)}
    )
    assert LinearFactory(torch.float32, torch.device("cpu"), mode="auto", table=table).table is None


def test_the_table_round_trips_and_bad_ones_are_named() -> None:
    table = KernelTable(
        cpu="x", threads=2, dtype="float32", entries={"64x48|row-major|native+plain": (("native", 1), ("plain", 16))}
    )
    assert KernelTable.from_json(table.to_json()) == table
    assert KernelTable.from_json(table.to_json()).digest == table.digest
    with pytest.raises(ValueError, match="not JSON"):
        KernelTable.from_json("{nope")
    with pytest.raises(ValueError, match="version"):
        KernelTable.from_json(json.dumps({"version": 99}))
    with pytest.raises(ValueError, match="entry '64x48'"):
        KernelTable.from_json(json.dumps({"version": 1, "cpu": "x", "threads": 1, "entries": {"64x48": [["gpu", 1]]}}))


def test_linear_shapes_are_the_fused_projections_and_the_head() -> None:
    assert linear_shapes(CONFIG) == [((4 + 2 * 2) * 16, 64), (64, 64), (192, 64), (64, 96), (320, 64)]


def test_the_table_is_timed_once_per_machine_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    threads = torch.get_num_threads()
    try:
        path = ensure_table(model, "float32", 1)
    finally:
        torch.set_num_threads(threads)
    assert path == cache_path(model, "float32", 1)
    table = KernelTable.load(str(path))
    assert table.cpu == cpu_identity() and table.threads == 1 and len(table.entries) == 5
    stamp = path.stat().st_mtime_ns
    assert ensure_table(model, "float32", 1) == path and path.stat().st_mtime_ns == stamp  # read, not retimed
    assert cache_path(model, "float32", 2) != path and cache_path(model, "bfloat16", 1) != path
    # the launcher's side reads the cached table and hands it to every worker's config
    config = with_kernel_table(local_deployment(model=str(model), dtype="float32"), 1)
    assert KernelTable.from_json(config.model.kernel_table or "") == table


def test_no_table_where_none_applies(tmp_path: Path) -> None:
    base = local_deployment(model=str(tmp_path), deterministic=True)
    assert with_kernel_table(base, 1) is base  # deterministic mode runs native at every row count
    cuda = local_deployment(model=str(tmp_path), device="cuda")
    assert with_kernel_table(cuda, 1) is cuda  # the GPU runs one kernel (torch's)
    assert with_kernel_table(local_deployment(model=str(tmp_path)), 1).model.kernel_table is None  # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64}))  # not Llama-shaped
    assert with_kernel_table(local_deployment(model=str(tmp_path)), 1).model.kernel_table is None
