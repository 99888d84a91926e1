"""Selection policies: round-robin order, least-loaded picks, unhealthy workers skipped."""

from __future__ import annotations

import pytest

from pdserve.router.policies import (
    DECODE,
    PREFILL,
    Candidate,
    LeastLoaded,
    RoundRobin,
    decode_load,
    estimate_prompt_tokens,
    make_policy,
    prefill_load,
)
from pdserve.v1 import common_pb2, router_pb2


def _c(address: str, healthy: bool = True, **load: int) -> Candidate:
    return Candidate(address=address, role=DECODE, healthy=healthy, **load)


def test_round_robin_cycles_in_order() -> None:
    policy = RoundRobin()
    workers = [_c("a"), _c("b"), _c("c")]
    assert [policy.pick(workers).address for _ in range(7)] == list("abcabca")


def test_round_robin_skips_unhealthy() -> None:
    policy = RoundRobin()
    workers = [_c("a"), _c("b", healthy=False), _c("c")]
    assert [policy.pick(workers).address for _ in range(4)] == list("acac")


@pytest.mark.parametrize("policy", [RoundRobin(), LeastLoaded(decode_load)])
def test_no_healthy_worker_gives_none(policy) -> None:
    assert policy.pick([_c("a", healthy=False)]) is None
    assert policy.pick([]) is None


def test_least_loaded_prefill_uses_queued_plus_in_flight_prompt_tokens() -> None:
    policy = LeastLoaded(prefill_load)
    workers = [
        _c("a", queued_prompt_tokens=100, in_flight_prompt_tokens=0),
        _c("b", queued_prompt_tokens=10, in_flight_prompt_tokens=50),
        _c("c", queued_prompt_tokens=0, in_flight_prompt_tokens=200),
    ]
    assert policy.pick(workers).address == "b"


def test_least_loaded_prefill_breaks_ties_by_in_flight_requests() -> None:
    policy = LeastLoaded(prefill_load)
    workers = [_c("a", queued_prompt_tokens=10, in_flight=3), _c("b", queued_prompt_tokens=10, in_flight=1)]
    assert policy.pick(workers).address == "b"


def test_least_loaded_decode_uses_kv_fraction_and_requests() -> None:
    policy = LeastLoaded(decode_load)
    workers = [
        _c("a", kv_blocks_used=90, kv_blocks_total=100, running_requests=2),
        _c("b", kv_blocks_used=10, kv_blocks_total=100, running_requests=2),
        _c("c", kv_blocks_used=0, kv_blocks_total=100, running_requests=1, in_flight=3),
    ]
    assert policy.pick(workers).address == "b"


def test_least_loaded_skips_unhealthy_even_if_idle() -> None:
    policy = LeastLoaded(decode_load)
    workers = [_c("idle", healthy=False), _c("busy", running_requests=5)]
    assert policy.pick(workers).address == "busy"


def test_least_loaded_rotates_among_equal_loads() -> None:
    policy = LeastLoaded(decode_load)
    workers = [_c("a"), _c("b")]
    assert {policy.pick(workers).address for _ in range(2)} == {"a", "b"}


def test_make_policy_validates_names() -> None:
    assert isinstance(make_policy("round_robin", PREFILL), RoundRobin)
    assert isinstance(make_policy("least_loaded", DECODE), LeastLoaded)
    with pytest.raises(ValueError, match="policy must be one of"):
        make_policy("random", DECODE)
    with pytest.raises(ValueError, match="stage"):
        make_policy("round_robin", "colocated")


def test_estimate_prompt_tokens() -> None:
    assert estimate_prompt_tokens(router_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[1, 2, 3]))) == 3
    assert estimate_prompt_tokens(router_pb2.GenerateRequest(prompt="a" * 40)) == 10
    chat = common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="user", content="a" * 40)])
    assert estimate_prompt_tokens(router_pb2.GenerateRequest(messages=chat)) == 18


def test_prefix_affinity_sends_a_shared_prefix_to_one_worker_and_spreads_others() -> None:
    from pdserve.router.policies import PrefixAffinity, prefix_key

    policy = PrefixAffinity(max_imbalance=1000)
    workers = [_c(f"10.0.0.{i}:1") for i in range(4)]
    shared = "You are a helpful assistant. " * 20
    keys = [prefix_key(router_pb2.GenerateRequest(prompt=shared + q)) for q in ("a?", "b?", "c?")]
    assert len({policy.pick(workers, k).address for k in keys}) == 1  # type: ignore[union-attr]
    spread = {policy.pick(workers, f"prompt {i}").address for i in range(40)}  # type: ignore[union-attr]
    assert len(spread) == 4
    favourite = policy.pick(workers, keys[0])
    assert favourite is not None
    loaded = [_c(w.address, queued_prompt_tokens=5000 if w.address == favourite.address else 0) for w in workers]
    assert policy.pick(loaded, keys[0]).address != favourite.address  # type: ignore[union-attr]


def test_decode_prefix_affinity_keeps_a_prefix_on_one_decode_worker_within_a_load_bound() -> None:
    from pdserve.router.config import RouterConfig
    from pdserve.router.policies import make_policy, prefix_key

    policy = make_policy("prefix_affinity", "decode")
    assert RouterConfig(decode_policy="prefix_affinity").decode_policy == "prefix_affinity"
    workers = [_c(f"10.0.0.{i}:1") for i in range(3)]
    shared = "System: answer briefly. " * 20
    keys = [prefix_key(router_pb2.GenerateRequest(prompt=shared + q)) for q in ("x", "y", "z")]
    chosen = {policy.pick(workers, k).address for k in keys}  # type: ignore[union-attr]
    assert len(chosen) == 1
    busy = [_c(w.address, running_requests=20 if w.address in chosen else 0) for w in workers]
    assert policy.pick(busy, keys[0]).address not in chosen  # type: ignore[union-attr]
