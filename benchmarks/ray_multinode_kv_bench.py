"""KV transfer between the nodes of a local multi-node Ray cluster, against memcpy of the same bytes,
same run.

A head and two worker nodes (`ray.cluster_utils.Cluster`: each its own raylet and object store) on
this host. A sender actor on node-a sends the K/V of an N-token prompt (the default model's
geometry, float32) to an actor on node-b:
- "ray x-node": the "ray" backend (ray.put on node-a, receive_kv on node-b: header check, ray.get,
  which pulls the object into node-b's store), until its ack;
- "ray same": the same to an actor on node-a (zero-copy ray.get from the shared store);
- "grpc x-node": the "grpc" backend to a KvTransfer server in an actor on node-b, until that actor
  holds all of it.
memcpy is a warm `Tensor.copy_` of the same bytes inside the sending actor, measured in the same run
right before the sends. Medians of --repeats sends after a warm-up.

The nodes share one host: "across nodes" moves bytes between two object stores (or two processes)
over loopback TCP, not over a network; on real nodes the network sets the bound.

  python benchmarks/ray_multinode_kv_bench.py [--tokens 128 512 2048] [--repeats 5]
"""

from __future__ import annotations

import argparse

from kv_transfer_bench import SMOLLM2, kv_for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    from pdserve.cluster.ray_kv_bench import cross_node_seconds

    specs = {t: kv_for(t) for t in args.tokens}
    ray_times = cross_node_seconds(
        [(t, spec.shape) for t, (spec, _) in specs.items()], SMOLLM2["block_size"], args.repeats
    )
    cols = ("memcpy", "ray_same", "ray_cross", "grpc_cross")
    print(
        f"{'tokens':>7} {'MiB':>7} "
        + " ".join(f"{c + ' GB/s':>15}" for c in cols)
        + " "
        + " ".join(f"{c + '/memcpy':>17}" for c in cols[1:])
    )
    for t, (spec, _) in specs.items():
        secs = ray_times[t]
        gb = spec.nbytes / 1e9
        print(
            f"{t:7d} {spec.nbytes / 2**20:7.1f} "
            + " ".join(f"{gb / secs[c]:15.2f}" for c in cols)
            + " "
            + " ".join(f"{secs['memcpy'] / secs[c]:17.3f}" for c in cols[1:]),
            flush=True,
        )


if __name__ == "__main__":
    main()
