"""Weight layout and kernel of the default model's linears at small row counts, same process.

The fast forward (engine/fast_forward.py) stores every weight column-major ([K, N] contiguous,
used through an [N, K] view). This times one pass over weights of the default model's shapes
(30 layers of fused qkv, o, fused gate/up and down, plus the LM head: about 540 MB, more than any
cache, as in a decode step) with each kernel, in alternating rounds so a shared machine's load
falls on all alike: `F.linear` over row-major weights, `F.linear` over column-major ones, the
oneDNN linear over weights reordered once, and pdserve's native kernel (engine/native.py, row-major)
where it runs. Prints the best and median round per kernel, with the read rate of the best round,
and the read rate of one large tensor sum in the same process.

  python benchmarks/gemv_layout.py --rows 1 2 4 32 --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

#: (K, N) of the default model's per-layer linears: fused qkv, o, fused gate/up, down.
LAYER_SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))
LM_HEAD = (576, 49152)


def kernels(layers: int) -> dict[str, Callable[[dict[int, torch.Tensor]], None]]:
    """kernel name -> one pass over every weight, given the input rows per K."""
    torch.manual_seed(0)
    rows_major = [torch.randn(n, k) for _ in range(layers) for k, n in LAYER_SHAPES]
    rows_major.append(torch.randn(LM_HEAD[1], LM_HEAD[0]))
    column_major = [w.t().contiguous().t() for w in rows_major]
    packed = [(w.shape[1], torch.ops.mkldnn._reorder_linear_weight(w, None)) for w in rows_major]

    def plain(weights: list[torch.Tensor]) -> Callable[[dict[int, torch.Tensor]], None]:
        def run(xs: dict[int, torch.Tensor]) -> None:
            for w in weights:
                F.linear(xs[w.shape[1]], w)

        return run

    def onednn(xs: dict[int, torch.Tensor]) -> None:
        for k, w in packed:
            torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")

    runs = {"row-major": plain(rows_major), "column-major": plain(column_major), "packed": onednn}
    from pdserve.engine.native import native_linear, native_unavailable

    if native_unavailable(torch.float32, torch.device("cpu")) is None:

        def native(xs: dict[int, torch.Tensor]) -> None:
            for w in rows_major:
                native_linear(xs[w.shape[1]], w)

        runs["native"] = native
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    runs = kernels(args.layers)
    total = sum(n * k * 4 for k, n in LAYER_SHAPES) * args.layers + LM_HEAD[0] * LM_HEAD[1] * 4
    big = torch.ones(total // 4)
    sums = []
    for _ in range(5):
        start = time.perf_counter()
        big.sum()
        sums.append(time.perf_counter() - start)
    del big
    print(
        f"{torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}; "
        f"{total / 1e6:.0f} MB of weights; one tensor sum of that size reads {total / min(sums) / 1e9:.1f} GB/s"
    )
    with torch.inference_mode():
        for rows in args.rows:
            xs = {k: torch.randn(rows, k) for k in (576, 1536)}
            times: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(args.rounds):
                for name, run in runs.items():
                    start = time.perf_counter()
                    run(xs)
                    times[name].append(time.perf_counter() - start)
            print(
                f"rows {rows}: "
                + ", ".join(
                    f"{name} best {min(t) * 1e3:.1f} ms ({total / min(t) / 1e9:.1f} GB/s), median "
                    f"{statistics.median(t) * 1e3:.1f} ms"
                    for name, t in times.items()
                )
            )


if __name__ == "__main__":
    main()
