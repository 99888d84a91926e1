"""pdserve's own forward pass for the Llama family (Llama, Mistral, Qwen2, Qwen3) over the paged cache.

transformers' modules, driven layer by layer, cost three q/k/v GEMMs and two gate/up GEMMs per layer
and a dozen small eager ops around each. This module runs the same arithmetic from the same weights
with fewer, larger operations:

- **Fused projections, made at load.** q, k and v become one [Nq + 2 Nkv, E] weight and gate and up
  one [2 I, E] weight (with their biases, Qwen2's q/k/v included). The transformers modules are
  re-pointed at row views of the fused tensors, so nothing is stored twice and the general path
  (`ModelRunner(forward="hf")`) still runs from the same memory.
- **Kernels chosen per weight, measured at load.** Each distinct GEMM shape is timed once, at 1 to
  64 rows, with every kernel the machine has: pdserve's own AVX2 kernel (engine/native.py,
  fastest at the few rows of a decode step), a plain `F.linear`, and a oneDNN linear whose weight
  was reordered once (`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`, the oneDNN
  path vLLM's CPU build takes through its own binding; 1.5-3x at 16-64 rows on the AVX2 EPYC of
  docs/performance.md). Each row count runs its fastest. A reordered weight is an extra copy of
  that weight; `PDSERVE_LINEAR=native|plain|packed|auto` overrides the choice (the exactness tests
  run each kernel). The choice is remembered per machine (see LinearFactory);
  `PDSERVE_LINEAR=retime` times again, e.g. after timing on a busy machine.
- **Weight layout.** Where the native kernel runs, weights stay row-major ([N, K], its layout and
  transformers'). Elsewhere every weight this module multiplies by is stored as its transpose
  ([K, N] contiguous) and seen as an [N, K] view: MKL's one-row GEMV runs 1.4-1.7x faster from
  that layout on the AVX2 EPYC.
- **Few ops per layer.** A norm is one native kernel call where the native kernels run (else one
  `F.rms_norm`), RoPE of q and k together is a roll and three elementwise ops over tables built
  once per pass (`Rope`), the residual adds ride in the o and down GEMMs (inside the native kernel
  or an `addmm`), and SiLU's product is taken in place.
- **The attention** is `engine.attention.paged_attention`, which the transformers path uses too
  (its decode part is a native kernel reading the pages in place, where the native kernels run).

Exactness: the norms are `F.rms_norm` with the model's own weight and epsilon (bit for bit the
modules' fp32 arithmetic) or the native norm (the same arithmetic, its sum of squares in another
order), the native linears sum in another order than MKL, `Rope` computes transformers'
`apply_rotary_pos_emb` bit for bit over the model's own rotary tables, and the MLP is
`act(gate) * up`, so greedy fp32 output stays token-identical to Hugging Face;
tests/engine/test_fast_forward.py holds it to that per family and kernel.

Anything outside the shapes this module knows (another activation, a norm with a bias, sliding
windows) falls back to the transformers path: `FastForward.build` returns None and says why.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from pdserve.engine.attention import AttentionBatch, paged_attention
from pdserve.engine.compiled_layer import CompiledDecode, norm_weight, packed_linear
from pdserve.engine.kernel_table import KERNELS, Bands, KernelTable, as_bands, cpu_identity
from pdserve.engine.native import native_linear, native_rms_norm, native_unavailable

log = logging.getLogger(__name__)

#: model_type -> whether its attention has per-head q/k RMSNorm (Qwen3).
FAST_FAMILIES = {"llama": False, "mistral": False, "qwen2": False, "qwen3": True}
LINEAR_ENV = "PDSERVE_LINEAR"
_LINEAR_MODES = ("auto", "native", "plain", "packed", "retime")


@functools.cache
def mkldnn_linear_available(dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU have a oneDNN linear kernel for `dtype`."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), None)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(2, 8, dtype=dtype), w, None, "none", [], "")
    except RuntimeError:  # e.g. bf16 on a CPU without AVX-512 BF16 / AVX-NE-CONVERT
        return False
    return True


def _runs_packed(bands: Bands) -> bool:
    """Whether some row count runs the packed kernel (which needs the reordered weight)."""
    return any(kernel == "packed" for kernel, _ in bands)


class Linear:
    """y = x W^T + b (+ residual) through the kernel chosen for this weight and this many rows.

    `bands` lists (kernel, from_rows) in ascending row order: a call with T rows runs the last
    kernel whose from_rows <= T. Kernels: "native" (engine/native.py, row-major weight),
    "plain" (`F.linear` / `addmm` over the weight as stored) and "packed" (the oneDNN linear over
    `packed`, the weight reordered once). `weight` stays the plain [N, K] tensor either way."""

    __slots__ = ("weight", "bias", "packed", "bands")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        packed: torch.Tensor | None = None,
        bands: tuple[tuple[str, int], ...] = (("plain", 1),),
    ) -> None:
        if _runs_packed(bands) and packed is None:
            raise ValueError("a packed band needs the reordered weight")
        self.weight, self.bias, self.packed, self.bands = weight, bias, packed, bands

    def kernel_for(self, rows: int) -> str:
        kernel = self.bands[0][0]
        for name, from_rows in self.bands[1:]:
            if rows < from_rows:
                break
            kernel = name
        return kernel

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] -> [T, N]; plus `residual` [T, N] when given (inside the native kernel, one
        addmm on the plain one)."""
        kernel = self.kernel_for(x.shape[0])
        if kernel == "native":
            return native_linear(x, self.weight, self.bias, residual)
        if kernel == "packed":
            if torch.compiler.is_compiling():  # traced into the compiled decode layer
                y = packed_linear(x, self.packed, self.bias)
            else:
                y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        elif residual is not None and self.bias is None:
            return torch.addmm(residual, x, self.weight.t())
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if residual is None else residual + y


#: Row counts timed per weight shape to choose its kernels.
PROBE_ROWS = (1, 2, 4, 8, 16, 64)
#: How the kernels are timed, part of a remembered choice's key: choices timed otherwise are timed again.
TIMING = "cold-best-of-7"
#: Copies of a weight timed in turn: at most this many, together at least the last-level cache.
MAX_COPIES = 32


@functools.cache
def _last_level_cache_bytes() -> int:
    """The largest CPU cache (Linux sysfs), or 32 MiB where it cannot be read."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text().strip().upper()
            sizes.append(int(text.rstrip("KMG")) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1))
        except (OSError, ValueError):
            continue
    return max(sizes, default=32 * 2**20)


def _cold_copies(weight: torch.Tensor) -> int:
    """How many copies of `weight`, timed one after another, read it from memory rather than cache."""
    size = weight.numel() * weight.element_size()
    return max(1, min(MAX_COPIES, -(-2 * _last_level_cache_bytes() // size)))


def _best_ms(runs: dict[str, Any], repeats: int = 7) -> dict[str, float]:
    """Each kernel's best time in ms over `repeats` rounds (after one warm-up each). The kernels take
    turns within every round, so a machine's passing load falls on all of them alike."""
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run()
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - start)
    return {name: min(times) * 1e3 for name, times in samples.items()}


def _machine_key() -> str:
    """What a kernel timing depends on: the CPU model, torch's view of it, torch and the threads."""
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return (
        f"{model}|{torch.backends.cpu.get_cpu_capability()}|torch {torch.__version__}|{torch.get_num_threads()} threads"
    )


def _choices_file() -> Path:
    from pdserve.model_cache import cache_root

    return cache_root() / "linear-kernels.json"


def _read_choices() -> dict[str, Bands]:
    try:
        data = json.loads(_choices_file().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: bands for k, v in data.items() if (bands := as_bands(v)) is not None}


def _write_choices(choices: dict[str, Bands]) -> None:
    """Best effort and atomic: a worker that cannot write only times again next start."""
    target = _choices_file()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        merged = {k: [list(b) for b in bands] for k, bands in {**_read_choices(), **choices}.items()}
        tmp = target.with_name(f".{target.name}.{os.getpid()}")
        tmp.write_text(json.dumps(merged, indent=1, sort_keys=True))
        os.replace(tmp, target)
    except OSError:
        pass


class LinearFactory:
    """Builds `Linear`s. In "auto" mode each distinct (K, N) shape is timed once at PROBE_ROWS rows
    with every kernel this machine has (best of interleaved rounds); each probed row count takes its
    fastest kernel, up to the next probed count. The choice is kept in pdserve's cache folder
    (`linear-kernels.json`) under the CPU model, torch version, thread count, dtype, weight layout
    and kernels, so a restarted worker on the same machine does not time again.
    `PDSERVE_LINEAR=native|plain|packed` runs one kernel at every row count (the exactness tests run
    each) and `retime` times again.

    Layout: where the native kernel can run, weights stay row-major (its layout, and transformers');
    otherwise they are stored column-major, which MKL's one-row GEMV reads 1.4-1.7x faster
    (`column_major`)."""

    def __init__(
        self, dtype: torch.dtype, device: torch.device, mode: str | None = None, table: KernelTable | None = None
    ) -> None:
        mode = (mode or os.environ.get(LINEAR_ENV) or "auto").lower()
        if mode not in _LINEAR_MODES:
            raise ValueError(f"{LINEAR_ENV}={mode!r}: expected one of {', '.join(_LINEAR_MODES)}")
        self.can_pack = device.type == "cpu" and mkldnn_linear_available(dtype)
        self.native_reason = (
            native_unavailable(dtype, device) if mode in ("auto", "retime", "native") else f"{LINEAR_ENV}={mode}"
        )
        for kernel, can in (("packed", self.can_pack), ("native", self.native_reason is None)):
            if mode == kernel and not can:
                why = f" ({self.native_reason})" if kernel == "native" else ""
                log.warning(
                    "%s=%s: that kernel is not available for %s here%s; using F.linear", LINEAR_ENV, kernel, dtype, why
                )
        self.kernels = [
            k for k, can in (("native", self.native_reason is None), ("plain", True), ("packed", self.can_pack)) if can
        ]
        retime = mode == "retime"  # "auto", timing again and replacing what the cache holds
        if mode in KERNELS:
            self.mode = mode if mode in self.kernels else "plain"
        else:
            self.mode = "auto" if len(self.kernels) > 1 else "plain"
        self.column_major = "native" not in self.kernels or self.mode in ("plain", "packed")
        self.dtype = str(dtype).removeprefix("torch.")
        self.machine = _machine_key()
        self.remembered = _read_choices() if self.mode == "auto" and not retime else {}
        self.bands: dict[tuple[int, int], Bands] = {}  # (K, N) -> its kernels by row count
        self.timings: dict[tuple[int, int], dict[int, dict[str, float]]] = {}  # rows -> kernel -> ms
        self.table, self.table_miss = self._usable_table(table), ""
        self.off_table: list[tuple[int, int]] = []  # shapes whose kernels this process chose (not the table)

    def _usable_table(self, table: KernelTable | None) -> KernelTable | None:
        """`table` where this machine and mode can follow it (else None, `table_refused` says why)."""
        self.table_refused = ""
        if table is None or self.mode != "auto":
            return None
        if table.cpu != cpu_identity():
            self.table_refused = f"this CPU ({cpu_identity()}) is not the table's ({table.cpu})"
        elif table.dtype != self.dtype:
            self.table_refused = f"the table is for {table.dtype}, this model runs {self.dtype}"
        if self.table_refused:
            log.warning("kernel table %s not used: %s; timing this worker's own", table.digest, self.table_refused)
            return None
        return table

    def _known_bands(self, k: int, n: int) -> Bands | None:
        """The shape's bands: the deployment's table's, else already timed (here or by an earlier
        start), else None."""
        if (k, n) not in self.bands and self.table is not None:
            listed = self.table.entries.get(self.entry_key(k, n))
            if listed is not None and all(kernel in self.kernels for kernel, _ in listed):
                self.bands[(k, n)] = listed
            else:
                self.table_miss = self.table_miss or f"{k}x{n} is not in it"
        if (k, n) not in self.bands:
            remembered = self.remembered.get(self._key(k, n))
            if remembered is None or any(kernel not in self.kernels for kernel, _ in remembered):
                return None
            self.bands[(k, n)] = remembered
        return self.bands[(k, n)]

    def _time_bands(self, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None) -> Bands:
        n, k = weight.shape
        # A decode step streams every weight from memory, so each kernel is timed over enough copies of
        # the weight to overflow the last-level cache: timed hot, a few-MB weight read from L3 ranks the
        # kernels differently (MKL's GEMV gains most from the cache).
        weights = [weight] + [weight.clone() for _ in range(_cold_copies(weight) - 1)]
        packs = [packed] + [self._pack(w) for w in weights[1:]] if packed is not None else []

        def over_copies(kernel: Any) -> Any:
            return lambda x: [kernel(x, i) for i in range(len(weights))]

        runs = {
            "native": over_copies(lambda x, i: native_linear(x, weights[i], bias)),
            "plain": over_copies(lambda x, i: F.linear(x, weights[i], bias)),
            "packed": over_copies(lambda x, i: torch.ops.mkldnn._linear_pointwise(x, packs[i], bias, "none", [], "")),
        }
        runs = {
            name: run for name, run in runs.items() if name in self.kernels and (name != "packed" or packed is not None)
        }
        timings: dict[int, dict[str, float]] = {}
        generator = torch.Generator(device=weight.device).manual_seed(0)  # leaves the global RNG alone
        bands: list[tuple[str, int]] = []
        for rows in PROBE_ROWS:
            x = torch.randn(rows, k, generator=generator, device=weight.device).to(weight.dtype)
            ms = timings[rows] = _best_ms({name: functools.partial(run, x) for name, run in runs.items()})
            best = min(ms, key=ms.__getitem__)
            if not bands or bands[-1][0] != best:
                bands.append((best, rows))
        self.bands[(k, n)], self.timings[(k, n)] = tuple(bands), timings
        self.remembered[self._key(k, n)] = tuple(bands)
        _write_choices(self.remembered)
        return tuple(bands)

    def entry_key(self, k: int, n: int) -> str:
        """A weight shape's key in a kernel table: its shape, layout and the kernels it chose among."""
        layout = "column-major" if self.column_major else "row-major"
        return f"{k}x{n}|{layout}|{'+'.join(self.kernels)}"

    def _key(self, k: int, n: int) -> str:
        return f"{self.machine}|{self.dtype}|{self.entry_key(k, n)}|{TIMING}"

    def describe_use(self) -> str:
        """Where this model's kernel choices came from (`pdserve status`)."""
        if self.mode != "auto":
            return f"every linear {self.mode}"
        if self.table is not None and not self.off_table:
            return f"deployment table {self.table.digest} ({self.table.threads} threads)"
        if self.table is not None:
            return (
                f"deployment table {self.table.digest}, own timing for {len(self.off_table)} shapes ({self.table_miss})"
            )
        why = self.table_refused or "no deployment table"
        return f"own timing ({why})"

    def __call__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        weight = weight.detach()
        bias = None if bias is None else bias.detach()
        if self.mode != "auto":
            packed = self._pack(weight) if self.mode == "packed" else None
            return Linear(weight, bias, packed, ((self.mode, 1),))
        n, k = weight.shape
        bands = self._known_bands(k, n)
        packed = None
        if bands is None or _runs_packed(bands):
            packed = self._pack(weight) if self.can_pack else None
        if bands is None:
            bands = self._time_bands(weight, bias, packed)
        if self.table is not None and self.bands[(k, n)] is not self.table.entries.get(self.entry_key(k, n)):
            self.off_table.append((k, n))
        if not _runs_packed(bands):
            packed = None  # no reordered copy is kept for a weight that never runs packed
        return Linear(weight, bias, packed, bands)

    @staticmethod
    def _pack(weight: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def describe(self) -> str:
        if self.mode != "auto":
            return f"every linear {self.mode}"
        return "; ".join(
            f"{k}x{n}: " + ", ".join(f"{kernel} from {rows}" for kernel, rows in bands)
            for (k, n), bands in self.bands.items()
        )


def _column_major(weight: torch.Tensor) -> torch.Tensor:
    """The same [N, K] weight stored as its transpose ([K, N] contiguous, strides (1, N)).

    At one row (a batch-1 decode step) MKL's GEMV reads this layout 1.4-1.7x faster than the
    row-major one on the AVX2 EPYC of docs/performance.md; at 32-256 rows the two are within noise
    of each other and the packed oneDNN kernel (reordered from either) is faster than both where
    the load-time timing picks it. `F.linear` takes the strided view as it is. Used only where the
    native kernel (row-major) cannot run."""
    return weight.t().contiguous().t()


def _fuse(module_list: list[torch.nn.Linear], attr: str, column_major: bool = False) -> torch.Tensor | None:
    """Concatenate the modules' `attr` (weight or bias) along the output rows (weights column-major
    if asked) and re-point each module's parameter at its row view of the fused tensor (no second
    copy stays alive). One module is "fused" alone to get its weight into that layout."""
    parts = [getattr(m, attr) for m in module_list]
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise ValueError("some fused projections have a bias and some do not")
    fused = torch.cat([p.detach() for p in parts], dim=0) if len(parts) > 1 else parts[0].detach()
    if attr == "weight":
        fused = _column_major(fused) if column_major else fused.contiguous()
    start = 0
    for module, part in zip(module_list, parts, strict=True):
        rows = part.shape[0]
        getattr(module, attr).data = fused[start : start + rows]
        start += rows
    return fused


def _fuse_weights(module_list: list[torch.nn.Linear], column_major: bool) -> torch.Tensor:
    """`_fuse` of the weights, which every linear layer has."""
    fused = _fuse(module_list, "weight", column_major)
    assert fused is not None, "a linear layer without a weight"
    return fused


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor, native: bool = False) -> torch.Tensor:
    """The model's RMSNorm module as one call where its dtype allows: pdserve's native kernel when
    `native` (one pass per row, float32 or bfloat16, rounded where the module rounds; the sum of
    squares in another order than torch's), else `F.rms_norm` in float32 (the module's own
    arithmetic, bit for bit, in seven ops instead of the module's dozen); the module itself otherwise."""
    eps = getattr(norm, "variance_epsilon", None)
    weight = norm_weight(norm)
    if eps is None or x.dtype != weight.dtype:
        return norm(x)
    if native and x.dim() == 2 and x.stride(1) == 1 and x.dtype in (torch.float32, torch.bfloat16):
        return native_rms_norm(x, weight, eps)
    if x.dtype != torch.float32:
        return norm(x)
    return F.rms_norm(x, weight.shape, weight, eps)


class Rope:
    """Rotary embedding of one pass: x [T, H, D] -> x cos + rotate_half(x) sin, as transformers'
    `apply_rotary_pos_emb` computes it, bit for bit. rotate_half(x) sin = cat(-x2, x1) sin is
    computed as roll(x) times sin with its first half negated once per pass (-a b == a (-b)
    exactly), so q and k together take a roll and three elementwise ops instead of about eighteen
    (tests/engine/test_fast_forward.py checks the bits against transformers')."""

    __slots__ = ("cos", "signed_sin", "half")

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:  # [T, D] each
        self.half = cos.shape[-1] // 2
        self.cos = cos.unsqueeze(1)  # [T, 1, D]
        self.signed_sin = torch.cat([-sin[:, : self.half], sin[:, self.half :]], dim=-1).unsqueeze(1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.cos).add_(x.roll(self.half, dims=-1).mul_(self.signed_sin))


@dataclass
class _Layer:
    input_norm: torch.nn.Module  # the model's own RMSNorm modules: their arithmetic, unchanged
    post_norm: torch.nn.Module
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    q_norm: torch.nn.Module | None
    k_norm: torch.nn.Module | None


class FastForward:
    """The fused forward of one loaded model (shared by every engine of that model in a process)."""

    def __init__(
        self, model: Any, layers: list[_Layer], lm_head: Linear, factory: LinearFactory, deterministic: bool = False
    ) -> None:
        c = model.config
        self.model = model
        self.layers = layers
        self.lm_head = lm_head
        self.factory = factory
        self.embed = model.model.embed_tokens.weight
        self.final_norm = model.model.norm
        self.rotary = model.model.rotary_emb
        self.num_heads = int(c.num_attention_heads)
        self.num_kv_heads = int(c.num_key_value_heads)
        self.head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
        self.scale = self.head_dim**-0.5
        self.act = ACT2FN[c.hidden_act]
        self.intermediate = int(c.intermediate_size)
        self.compiled: CompiledDecode | None = None  # see enable_compile
        self.native = factory.native_reason is None  # the native norm (engine/native.py) runs too
        self.deterministic = deterministic  # batch-invariant: see `build`
        self._invariance: dict[tuple[int, ...], bool] = {}  # see thread_invariant

    @property
    def kernels(self) -> str:
        """How this forward's kernels were chosen (`pdserve status`)."""
        if self.deterministic:
            return "deterministic: native linear, norm and attention at every row count"
        return self.factory.describe_use()

    def enable_compile(self) -> None:
        """Run decode passes through the `torch.compile`d layer (engine/compiled_layer.py) from now on
        (idempotent; every engine sharing this forward then uses it)."""
        if self.compiled is not None:
            return
        reason = "deterministic mode" if self.deterministic else CompiledDecode.supported(self)
        if reason is not None:
            log.warning("model.compile: not used (%s); the layers run eagerly", reason)
            return
        self.compiled = CompiledDecode(self)
        log.info("model.compile: decode layers compile on first use (torch.compile, inductor)")

    # ---- construction ----------------------------------------------------------------------------
    @staticmethod
    def unsupported_reason(model: Any) -> str | None:
        """Why this model cannot take the fast path (None when it can)."""
        c = model.config
        if c.model_type not in FAST_FAMILIES:
            return f"model_type {c.model_type!r} is not one of {sorted(FAST_FAMILIES)}"
        if c.hidden_act not in ACT2FN:
            return f"activation {c.hidden_act!r}"
        if getattr(c, "use_sliding_window", False):
            return "sliding-window attention"
        layer = model.model.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not isinstance(getattr(attn, name, None), torch.nn.Linear):
                return f"self_attn.{name} is not a plain linear layer"
        for name in ("gate_proj", "up_proj", "down_proj"):
            if not isinstance(getattr(mlp, name, None), torch.nn.Linear):
                return f"mlp.{name} is not a plain linear layer"
        if getattr(model.model.norm, "bias", None) is not None:
            return "a norm with a bias"
        return None

    @classmethod
    def build(
        cls, model: Any, mode: str | None = None, table: KernelTable | None = None, deterministic: bool = False
    ) -> FastForward | None:
        """The model's fused forward, or None where it does not apply. `table`: the deployment's kernel
        choices (engine/kernel_table.py). `deterministic`: batch-invariant mode: every linear, norm and
        attention row runs pdserve's native kernels, whose sums for one row are the same at any row
        count, thread count and batch position (ValueError where they cannot run)."""
        reason = cls.unsupported_reason(model)
        weight = model.lm_head.weight
        if deterministic:
            reason = reason or native_unavailable(weight.dtype, weight.device)
            if reason is not None:
                raise ValueError(f"deterministic mode needs pdserve's native kernels and the fast forward: {reason}")
            mode = "native"
        if reason is not None:
            log.info("fast forward not used (%s): transformers' modules run the model", reason)
            return None
        factory = LinearFactory(weight.dtype, weight.device, mode, table)
        qwen3 = FAST_FAMILIES[model.config.model_type]
        cm = factory.column_major
        layers = []
        with torch.no_grad():
            for layer in model.model.layers:
                attn, mlp = layer.self_attn, layer.mlp
                projections = [attn.q_proj, attn.k_proj, attn.v_proj]
                gate_up = [mlp.gate_proj, mlp.up_proj]
                layers.append(
                    _Layer(
                        input_norm=layer.input_layernorm,
                        post_norm=layer.post_attention_layernorm,
                        qkv=factory(_fuse_weights(projections, cm), _fuse(projections, "bias")),
                        o=factory(_fuse_weights([attn.o_proj], cm), attn.o_proj.bias),
                        gate_up=factory(_fuse_weights(gate_up, cm), _fuse(gate_up, "bias")),
                        down=factory(_fuse_weights([mlp.down_proj], cm), mlp.down_proj.bias),
                        q_norm=attn.q_norm if qwen3 else None,
                        k_norm=attn.k_norm if qwen3 else None,
                    )
                )
            # tied embeddings: the embedding re-points too (one Parameter) and gathers strided rows
            lm_head = factory(_fuse_weights([model.lm_head], cm), getattr(model.lm_head, "bias", None))
        fast = cls(model, layers, lm_head, factory, deterministic)
        log.info("fast forward: %d layers; linear kernels: %s (%s)", len(layers), factory.describe(), fast.kernels)
        return fast

    # ---- the pass ----------------------------------------------------------------------------------
    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """The pass's rotary tables, from the model's own rotary module (its scaling rules included),
        built once per pass and read by every layer."""
        probe = torch.empty(1, dtype=dtype, device=positions.device)
        cos, sin = self.rotary(probe, position_ids=positions.unsqueeze(0))
        return Rope(cos[0], sin[0])

    def layer(self, index: int, hidden: torch.Tensor, batch: AttentionBatch, rope: Rope) -> torch.Tensor:
        """One decoder layer over the packed tokens: hidden [T, E] -> [T, E]."""
        if self.compiled is not None:
            out = self.compiled.layer(index, hidden, batch, rope)
            if out is not None:
                return out
        p = self.layers[index]
        t = hidden.shape[0]
        hq, hkv = self.num_heads, self.num_kv_heads
        qkv = p.qkv(_rms_norm(p.input_norm, hidden, self.native)).view(t, hq + 2 * hkv, self.head_dim)
        if p.q_norm is not None and p.k_norm is not None:  # Qwen3: per-head norms before RoPE
            q, k = rope(p.q_norm(qkv[:, :hq])), rope(p.k_norm(qkv[:, hq : hq + hkv]))
        else:  # q and k rotated together: one set of ops for both
            qk = rope(qkv[:, : hq + hkv])
            q, k = qk[:, :hq], qk[:, hq:]
        attn = paged_attention(
            batch,
            index,
            q,
            k,
            qkv[:, hq + hkv :],
            self.scale,  # [T, Hq * D]
            per_row=self.deterministic,
        )
        hidden = p.o(attn, residual=hidden)
        gate_up = p.gate_up(_rms_norm(p.post_norm, hidden, self.native))  # [T, 2 I]
        return p.down(self._act_mul(gate_up), residual=hidden)

    def _act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up over the fused [T, 2 I] output -> [T, I]."""
        gate, up = gate_up[:, : self.intermediate], gate_up[:, self.intermediate :]
        if not self.deterministic:
            return self.act(gate).mul_(up)
        # torch splits a large elementwise op across threads at element offsets that move with the
        # row count, and vectorized and tail elements of an activation (exp) may round differently:
        # slices under its parallel grain run serially, each row whole, the same bits at any batch
        rows = max(1, _SERIAL_GRAIN // max(1, self.intermediate))
        return torch.cat([self.act(gate[i : i + rows]).mul_(up[i : i + rows]) for i in range(0, len(gate), rows)])

    def thread_invariant(self, counts: tuple[int, ...], rows: tuple[int, ...] = (1, 8, 32, 64)) -> bool:
        """Whether every distinct linear of this model gives the same bits at each thread count in
        `counts` and these row counts (the thread governor's condition, engine/thread_governor.py).
        pdserve's own kernels split outputs, never a sum; this checks the others (oneDNN, MKL) on
        this CPU, once per thread-count set."""
        cached = self._invariance.get(counts)
        if cached is not None:
            return cached
        first = self.layers[0]
        linears = {(lin.weight.shape, lin.bands): lin for lin in (first.qkv, first.o, first.gate_up, first.down)}
        linears[(self.lm_head.weight.shape, self.lm_head.bands)] = self.lm_head
        before = torch.get_num_threads()
        generator = torch.Generator(device=self.embed.device).manual_seed(0)
        same = True
        try:
            with torch.inference_mode():
                for lin in linears.values():
                    # prompt chunks run through the layers' linears at hundreds of rows too
                    for m in rows if lin is self.lm_head else (*rows, 512):
                        x = torch.randn(m, lin.weight.shape[1], generator=generator).to(lin.weight.dtype)
                        outs = []
                        for n in counts:
                            torch.set_num_threads(n)
                            outs.append(lin(x))
                        same = same and all(torch.equal(outs[0], o) for o in outs[1:])
        finally:
            torch.set_num_threads(before)
        self._invariance[counts] = same
        return same

    def norm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden [N, E] -> float32 logits [N, V]."""
        return self.lm_head(_rms_norm(self.final_norm, hidden, self.native)).float()


#: Elements under which torch runs an elementwise op on one thread (at::internal::GRAIN_SIZE).
_SERIAL_GRAIN = 32768
_BUILT: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], FastForward | None]] = weakref.WeakKeyDictionary()


def fast_forward_for(
    model: Any, mode: str | None = None, table: KernelTable | None = None, deterministic: bool = False
) -> FastForward | None:
    """The model's FastForward, built on first use and shared by every engine of the process that asks
    for the same settings (other settings build it again over the same weights)."""
    settings = (mode, table, deterministic)
    if model not in _BUILT or _BUILT[model][0] != settings:
        _BUILT[model] = (settings, FastForward.build(model, mode, table, deterministic))
    return _BUILT[model][1]
