"""Small hand-made profiles for the simulator and sim-engine tests (not fixtures: plain builders)."""

from __future__ import annotations

from pdserve.engine.sim_profile import DecodeCost, EngineLimits, LinkCost, Overhead, PrefillCost, Profile


def make_profile(
    prefill: tuple[float, float, float] = (0.0, 0.0, 0.0),
    decode: tuple[float, float, float] = (0.0, 0.0, 0.0),
    transfer_s: float = 0.0,
    kv_capacity_tokens: int = 16 * 4096,
    max_num_seqs: int = 64,
    max_batched_tokens: int = 4096,
    prefill_chunk_tokens: int = 4096,
    overhead: Overhead | None = None,
    name: str = "test",
) -> Profile:
    """A profile with the given coefficients; the KV link costs exactly `transfer_s` per hand-off."""
    return Profile(
        name=name,
        model_name="tiny",
        kv_bytes_per_token=1.0,
        prefill=PrefillCost(*prefill),
        decode=DecodeCost(*decode),
        transfer={"shm": LinkCost(transfer_s, 1e18), "grpc": LinkCost(transfer_s, 1e18)},
        engine=EngineLimits(
            block_size=16,
            kv_capacity_tokens=kv_capacity_tokens,
            max_num_seqs=max_num_seqs,
            max_batched_tokens=max_batched_tokens,
            prefill_chunk_tokens=prefill_chunk_tokens,
        ),
        overhead=overhead or Overhead(),
    )
