"""KV-aware routing's parts without a model: the workers' event log, the router's index under churn,
the event stream over a real loopback gRPC server (snapshot, epoch change, gap, worker leaving, the
internal token), the kv_aware cost function and conditional disaggregation's decision."""

from __future__ import annotations

import grpc
import pytest
from waiting import eventually

from pdserve import transport
from pdserve.engine.block_pool import BlockPool, block_hashes
from pdserve.engine.kv_events import KvEventLog, event_key
from pdserve.router.kv_index import KvEventFeed, KvIndex, PromptKeys, _Subscription, key_of
from pdserve.router.policies import DECODE, PREFILL, Candidate, KvAware, RouteHint, make_policy
from pdserve.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc
from pdserve.worker.runtime import KvEventsServicer, bind, make_server

BS = 4


def _keys(ids: list[int], salt: str = "") -> list[int]:
    return [key_of(h) for h in block_hashes(ids, BS, salt)]


def test_the_log_numbers_events_and_answers_laggards_with_a_snapshot() -> None:
    log = KvEventLog(retain=3)
    assert log.read(0).snapshot and log.read(0).keys == ()
    hashes = block_hashes(list(range(20)), BS)
    for h in hashes[:4]:
        log.stored(h)
    log.removed(hashes[0])
    batch = log.read(3)
    assert (batch.first_seq, batch.last_seq, batch.snapshot) == (4, 5, False)
    assert batch.keys == (event_key(hashes[3]), event_key(hashes[0])) and batch.stored == (True, False)
    assert log.read(5) is None
    lagging = log.read(1)  # events 2..5 are not all retained (3 kept): a snapshot instead
    assert lagging.snapshot and lagging.last_seq == 5
    assert set(lagging.keys) == {event_key(h) for h in hashes[1:4]} == set(log.keys())
    assert log.lookup([event_key(h) for h in hashes[1:4]]) == 3 and log.lookup([event_key(hashes[0])]) == 0


def test_the_block_pool_publishes_what_it_caches_and_evicts() -> None:
    pool = BlockPool(num_blocks=2, block_size=BS)
    pool.events = log = KvEventLog()
    hashes = block_hashes(list(range(12)), BS)
    blocks = pool.allocate(2)
    for block, h in zip(blocks, hashes, strict=False):
        pool.cache_block(block, h)
    assert log.keys() == {event_key(h) for h in hashes[:2]}
    pool.free(blocks)  # cached and evictable: still held
    assert len(log.keys()) == 2
    pool.allocate(1)  # evicts the least recently used cached block
    assert log.keys() == {event_key(hashes[1])} and log.last_seq == 3


def test_the_index_gives_prefix_overlap_and_survives_churn() -> None:
    index = KvIndex()
    a, b = _keys(list(range(16))), _keys(list(range(8)) + [99] * 8)
    index.replace("w1", a)
    index.replace("w2", b)
    assert index.overlap(a) == {"w1": 4, "w2": 2}  # the chain: w2 shares the first two blocks only
    index.apply("w1", [a[1]], [False])  # evicted in the middle: w1's prefix ends at block 0
    assert index.overlap(a) == {"w1": 1, "w2": 2}
    index.drop("w2")  # a worker leaves
    assert index.overlap(a) == {"w1": 1} and index.workers() == ["w1"]
    index.replace("w1", [])  # a snapshot replaces everything
    assert index.overlap(a) == {} and len(index) == 0


def test_the_index_is_bounded() -> None:
    index = KvIndex(max_keys=5)
    index.replace("w1", _keys(list(range(16))))
    index.replace("w2", _keys(list(range(16))))
    assert len(index) == 5 and index.dropped == 3
    assert index.overlap(_keys(list(range(16)))) == {"w1": 4, "w2": 1}


def test_prompt_keys_match_the_workers_hashes_and_honour_the_salt() -> None:
    ids = list(range(1, 14))
    request = router_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=ids))
    keys, tokens = PromptKeys(None).keys(request, BS)
    assert tokens == 13 and keys == _keys(ids[:-1])  # the last prompt token is never a cache hit
    request.params.cache_salt = "tenant-a"
    salted, _ = PromptKeys(None).keys(request, BS)
    assert salted == _keys(ids[:-1], "tenant-a") and salted != keys


def test_a_huge_chat_is_hashed_from_its_leading_turns_only(tiny_llama_dir) -> None:  # noqa: ANN001
    """Over MAX_HASHED_CHARS of chat, the router renders only the leading turns within the budget:
    their tokens are a prefix of the whole chat's (its KV hint stays right), and a chat whose first
    turn alone is over the budget gets no hint rather than a full render."""
    from transformers import AutoTokenizer

    from pdserve.router.kv_index import MAX_HASHED_CHARS
    from pdserve.tokenization import encode_chat

    keys = PromptKeys(AutoTokenizer.from_pretrained(tiny_llama_dir))
    turns = [("user" if i % 2 == 0 else "assistant", f"turn {i}: " + "talk " * 2000) for i in range(12)]
    assert sum(len(c) for _, c in turns) > MAX_HASHED_CHARS
    request = router_pb2.GenerateRequest(
        messages=common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in turns])
    )
    hinted = keys.token_ids(request)
    whole = encode_chat(keys.tokenizer, turns)
    assert 0 < len(hinted) < len(whole) and whole[: len(hinted)] == hinted
    one_huge = router_pb2.GenerateRequest(
        messages=common_pb2.ChatMessages(
            messages=[common_pb2.ChatMessage(role="user", content="x " * MAX_HASHED_CHARS)]
        )
    )
    assert keys.token_ids(one_huge) == []


def test_recent_chains_reuse_a_seen_prefix_and_give_the_same_keys_as_hashing_whole() -> None:
    """Follow-ups, forks inside a block, other salts and block sizes: every prompt's keys equal those
    of hashing it whole, the shared blocks are hashed once, and the bound holds."""
    import random

    from pdserve.prefix_hashing import block_hashes
    from pdserve.router.kv_index import RecentChains

    rng = random.Random(7)
    chains = RecentChains(max_prompts=6, per_start=3)
    system = [rng.randrange(50_000) for _ in range(100)]  # 6 full blocks of 16 shared by every chat
    chats = [list(system) for _ in range(4)]
    for _turn in range(3):
        for chat in chats:
            chat += [rng.randrange(50_000) for _ in range(rng.randrange(1, 40))]
            for salt, block_size in (("", 16), ("", 4), ("tenant", 16)):
                expected = [key_of(h) for h in block_hashes(chat, block_size, salt)]
                assert chains.keys(chat, block_size, salt) == expected
    assert chains.reused_blocks > 0
    fork = chats[0][:37] + [50_001] + chats[0][38:]  # differs inside block 2 (of 16)
    reused = chains.reused_blocks
    assert chains.keys(fork, 16) == [key_of(h) for h in block_hashes(fork, 16)]
    assert chains.reused_blocks - reused == 2  # blocks 0 and 1 only
    assert chains._count <= 6 and all(len(c) <= 3 for c in chains._by_start.values())
    assert chains.keys(system[:15], 16) == []  # no full block


@pytest.fixture()
def event_server():
    """A real loopback worker server publishing one swappable log (`holder[0]`)."""
    holder = [KvEventLog()]
    server = make_server(control_threads=2, name="kv-events-test")
    worker_pb2_grpc.add_KvEventsServicer_to_server(KvEventsServicer("w", lambda: holder[0]), server)
    address = bind(server, "127.0.0.1", 0)
    server.start()
    yield address, holder
    server.stop(0)


def test_the_feed_follows_a_worker_through_events_an_epoch_change_and_its_removal(event_server) -> None:  # noqa: ANN001
    address, holder = event_server
    hashes = block_hashes(list(range(40)), BS)
    holder[0].stored(hashes[0])
    index = KvIndex()
    feed = KvEventFeed(index)
    feed.watch(address, transport.open_channel(address))  # as the router's pool: the internal token when set
    try:
        eventually(lambda: index.keys_of(address) == {event_key(hashes[0])}, 10)  # the first snapshot
        holder[0].stored(hashes[1])
        holder[0].stored(hashes[2])
        holder[0].removed(hashes[0])
        eventually(lambda: index.keys_of(address) == {event_key(h) for h in hashes[1:3]}, 10)
        holder[0] = KvEventLog()  # the worker changed role: a new engine, a new epoch, nothing cached
        holder[0].stored(hashes[5])
        eventually(lambda: index.keys_of(address) == {event_key(hashes[5])}, 10)
        feed.unwatch(address)
        assert index.overlap([event_key(hashes[5])]) == {}
    finally:
        feed.close()


def test_a_gap_in_the_sequence_asks_for_a_snapshot() -> None:
    index = KvIndex()
    sub = _Subscription(KvEventFeed(index), "w", grpc.insecure_channel("127.0.0.1:9"))
    assert sub._apply(
        worker_pb2.KvEventBatch(epoch=7, first_seq=1, last_seq=1, snapshot=True, keys=[11], stored=[True])
    )
    assert sub._apply(worker_pb2.KvEventBatch(epoch=7, first_seq=2, last_seq=2, keys=[12], stored=[True]))
    assert not sub._apply(worker_pb2.KvEventBatch(epoch=7, first_seq=5, last_seq=5, keys=[13], stored=[True]))
    assert (sub.epoch, sub.last_seq) == (0, 0)  # the next Subscribe starts from a snapshot
    assert index.keys_of("w") == {11, 12}  # nothing from after the gap was applied


def test_events_are_refused_without_the_internal_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(transport.ENV_TOKEN, "internal-secret")
    server = make_server(control_threads=2, name="kv-events-auth")
    log = KvEventLog()
    log.stored(block_hashes(list(range(8)), BS)[0])
    worker_pb2_grpc.add_KvEventsServicer_to_server(KvEventsServicer("w", lambda: log), server)
    address = bind(server, "127.0.0.1", 0)
    server.start()
    try:
        plain = worker_pb2_grpc.KvEventsStub(grpc.insecure_channel(address))
        with pytest.raises(grpc.RpcError) as err:
            next(iter(plain.Subscribe(worker_pb2.KvEventsRequest(), timeout=5)))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            plain.Lookup(worker_pb2.KvLookupRequest(keys=[1]), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        tokened = worker_pb2_grpc.KvEventsStub(transport.open_channel(address))
        first = next(iter(tokened.Subscribe(worker_pb2.KvEventsRequest(), timeout=5)))
        assert first.snapshot and len(first.keys) == 1 and first.worker_id == "w"
    finally:
        server.stop(0)


def _candidate(address: str, role: str = DECODE, **load: int) -> Candidate:
    return Candidate(address=address, role=role, healthy=True, **load)


def test_kv_aware_weighs_load_against_what_each_worker_caches() -> None:
    decode = make_policy("kv_aware", DECODE, request_tokens=100, kv_tokens=0)
    assert isinstance(decode, KvAware)
    hint = RouteHint(1000, {"d1": 800})
    d1, d2 = _candidate("d1", running_requests=1), _candidate("d2")
    assert decode.pick([d1, d2], hint=hint).address == "d1"  # 100 + 200 < 0 + 1000
    busy = _candidate("d1", running_requests=9)
    assert decode.pick([busy, d2], hint=hint).address == "d2"  # 900 + 200 > 1000
    prefill = make_policy("kv_aware", PREFILL)
    p1 = _candidate("p1", PREFILL, queued_prompt_tokens=500)
    p2 = _candidate("p2", PREFILL, queued_prompt_tokens=100)
    assert prefill.pick([p1, p2], hint=RouteHint(1000, {"p1": 1000})).address == "p1"  # 500 + 0 < 100 + 1000
    assert prefill.pick([p1, p2], hint=RouteHint(1000)).address == "p2"  # no cache anywhere: load alone


def test_a_router_whose_tokenizer_cannot_load_still_serves(fake_server, start_router, tmp_path) -> None:  # noqa: ANN001
    """A KV-aware router that cannot read its tokenizer (a Ray router on a node without the model
    folder) warns, starts and serves, routing by load."""
    from router_fakes import FakeDecode, FakePrefill

    from pdserve.router.config import RouterConfig

    config = RouterConfig(
        prefill=(fake_server(FakePrefill()),),
        decode=(fake_server(FakeDecode()),),
        prefill_policy="kv_aware",
        decode_policy="kv_aware",
        tokenizer=str(tmp_path / "no-model"),
    )
    _server, stub = start_router(config)
    responses = list(stub.Generate(router_pb2.GenerateRequest(prompt="hello"), timeout=10))
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP
