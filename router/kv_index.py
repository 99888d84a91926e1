"""The router's KV index: which worker holds which prefix blocks, fed by the workers' KV events.

Parts:
- `PromptKeys` tokenizes a request as the decode worker will (the same tokenizer, chat template and
  `pdserve.tokenization` code) and hashes it in the workers' block size, salt included, into the
  64-bit block keys the workers publish (`engine/kv_events.py`).
- `KvIndex` maps block key -> the workers holding it, and answers each worker's prefix overlap for
  a prompt's keys.
- `KvEventFeed` keeps one `KvEvents.Subscribe` stream per worker (a daemon thread each) and applies
  the batches; a gap in the sequence numbers, another epoch or a broken stream makes it subscribe
  again from a snapshot.

Invariants:
- The index is a hint, never a source of truth: a stale or wrong entry costs a recompute (the worker
  matches full sha256 hashes itself), never a wrong token.
- A worker's entries are exactly its last snapshot plus the events after it in order; a snapshot
  replaces them all. A worker that leaves the pool is dropped from the index.
- Bounded: at most `max_keys` (key, worker) entries in all (default 1,048,576, about 150 MB at the
  worst; a worker reports at most its block count). Past the bound new stored events are dropped
  and counted (`dropped`): a miss costs a recompute.
- The router tokenizes a prompt once per request, off the event loop for large ones; a request it
  cannot tokenize (a bad chat) gets no keys and is routed by load alone (the worker answers its 400).
  The ids of the pieces between special tokens (a chat's turns) are remembered (`PieceCache`, exact,
  bounded at 2M characters), so a follow-up turn costs the tokenizing of its new turns only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from pdserve.model_cache import default_model_dir
from pdserve.prefix_hashing import chain_hashes, chain_start, packed_blocks
from pdserve.tokenization import PieceCache, chat_from_pb, encode_chat, encode_text, input_chars
from pdserve.v1 import router_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

DEFAULT_MAX_KEYS = 1 << 20
#: A prompt longer than this (characters) is hashed from its first this-many characters only: the
#: tokens near the cut are dropped, and the rest of the prompt only extends a match the cache cannot
#: have without the start (bounds the router's tokenizing cost per request).
MAX_HASHED_CHARS = 64 * 1024
#: Tokens dropped at a cut (a word split by the cut tokenizes differently).
CUT_MARGIN_TOKENS = 8
#: Between two tries to subscribe to a worker whose stream failed.
RESUBSCRIBE_S = 0.5


def key_of(prefix_hash: bytes) -> int:
    """A block's 64-bit key, as the workers publish it (engine.kv_events.event_key)."""
    return int.from_bytes(prefix_hash[:8], "little")


class PromptKeys:
    """A request's block keys as the workers will compute them (see the module doc)."""

    def __init__(self, tokenizer: Any) -> None:  # noqa: ANN401 - a transformers tokenizer
        self.tokenizer = tokenizer
        # a follow-up turn re-sends the whole chat: only its new turns are tokenized (same ids)
        self.pieces = PieceCache(tokenizer) if tokenizer is not None else None
        self.chains = RecentChains()  # ... and only its new blocks are hashed

    @classmethod
    def load(cls, path: str) -> PromptKeys:
        """The tokenizer of the model folder `path` ("default": the default model's)."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(default_model_dir()) if path == "default" else path))

    def token_ids(self, request: router_pb2.GenerateRequest) -> list[int]:
        """The prompt's token ids (a prefix of them for a very long prompt); [] when it cannot be
        tokenized here."""
        kind = request.WhichOneof("input")
        try:
            if kind == "token_ids":
                return list(request.token_ids.ids)
            if kind == "prompt":
                if len(request.prompt) <= MAX_HASHED_CHARS:
                    return encode_text(self.tokenizer, request.prompt, self.pieces)
                return encode_text(self.tokenizer, request.prompt[:MAX_HASHED_CHARS], self.pieces)[:-CUT_MARGIN_TOKENS]
            if kind == "messages":
                messages, tools = chat_from_pb(request.messages)
                if input_chars(request) <= MAX_HASHED_CHARS:
                    return encode_chat(self.tokenizer, messages, tools, pieces=self.pieces)
                # a huge chat: its leading turns within the budget (a chat's turns render one after
                # another, so they render a prefix of it), less a margin; none fits: no hint
                kept, chars = [], len(request.messages.tools_json)
                for message in messages:
                    chars += len(message["content"]) + len(message["role"])
                    if chars > MAX_HASHED_CHARS:
                        break
                    kept.append(message)
                if not kept:
                    return []
                ids = encode_chat(self.tokenizer, kept, tools, pieces=self.pieces, add_generation_prompt=False)
                return ids[:-CUT_MARGIN_TOKENS]
        except Exception as exc:  # noqa: BLE001 - any failure only means "no hint"; the worker answers it
            log.debug("no KV keys for a request: %s", exc)
        return []

    def keys(self, request: router_pb2.GenerateRequest, block_size: int) -> tuple[list[int], int]:
        """(block keys of the prompt's full blocks, prompt tokens counted)."""
        ids = self.token_ids(request)
        if not ids or block_size <= 0:
            return [], len(ids)
        # the last prompt token is always computed (it yields the first token): never a cache hit
        return self.chains.keys(ids[:-1], block_size, request.params.cache_salt), len(ids)


#: RecentChains' bound: prompts whose block keys it keeps (about 30 KB each at 2,000 tokens: 30 MB).
RECENT_CHAINS = 1024
#: Prompts kept per first block (a shared system prompt starts many conversations).
CHAINS_PER_START = 8


class RecentChains:
    """The block keys of recent prompts, so that a prompt extending one seen before (a chat's
    follow-up turn re-sends the whole chat) hashes only its blocks past the longest common run of
    full blocks. Exact: a block's hash depends only on the tokens up to its end, and the common
    blocks are compared byte for byte, never by hash. Bounded: `max_prompts` prompts (least recently
    used out), at most `per_start` behind one first block. Thread-safe."""

    def __init__(self, max_prompts: int = RECENT_CHAINS, per_start: int = CHAINS_PER_START) -> None:
        self.max_prompts, self.per_start = max_prompts, per_start
        self._lock = threading.Lock()
        # (salt, block size, the first block's bytes) -> [(the prompt's packed blocks, hashes, keys)]
        self._by_start: OrderedDict[tuple[str, int, bytes], list[tuple[bytes, list[bytes], list[int]]]] = OrderedDict()
        self._count = 0
        self.reused_blocks = 0

    def keys(self, token_ids: Sequence[int], block_size: int, salt: str = "") -> list[int]:
        data, step = packed_blocks(token_ids, block_size), 8 * block_size
        if not data:
            return []
        start = (salt, block_size, data[:step])
        with self._lock:
            seen = list(self._by_start.get(start, ()))
        common, hashes, keys = 0, [], []
        for old_data, old_hashes, old_keys in seen:
            blocks = _common_blocks(data, old_data, step)
            if blocks > common:
                common, hashes, keys = blocks, old_hashes[:blocks], old_keys[:blocks]
        new = chain_hashes(data[common * step :], block_size, hashes[-1] if hashes else chain_start(salt))
        hashes = hashes + new
        keys = keys + [key_of(h) for h in new]
        with self._lock:
            self.reused_blocks += common
            chains = self._by_start.setdefault(start, [])
            self._by_start.move_to_end(start)
            before = len(chains)
            chains[:] = [c for c in chains if not data.startswith(c[0])][-(self.per_start - 1) :]
            chains.append((data, hashes, keys))
            self._count += len(chains) - before
            while self._count > self.max_prompts:
                _, dropped = self._by_start.popitem(last=False)
                self._count -= len(dropped)
        return keys


def _common_blocks(a: bytes, b: bytes, step: int) -> int:
    """How many whole blocks of `step` bytes `a` and `b` share from their start (binary search)."""
    low, high = 0, min(len(a), len(b)) // step
    while low < high:
        mid = (low + high + 1) // 2
        if a[: mid * step] == b[: mid * step]:
            low = mid
        else:
            high = mid - 1
    return low


class KvIndex:
    """Block key -> workers holding it, per worker its key set (see the module doc). Thread-safe."""

    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self._holders: dict[int, set[str]] = {}
        self._keys: dict[str, set[int]] = {}
        self._entries = 0
        self.dropped = 0  # stored events not indexed (the bound)
        self.applied = 0  # events applied

    def __len__(self) -> int:
        return self._entries

    def workers(self) -> list[str]:
        with self._lock:
            return list(self._keys)

    def keys_of(self, worker: str) -> frozenset[int]:
        with self._lock:
            return frozenset(self._keys.get(worker, ()))

    def replace(self, worker: str, keys: Sequence[int]) -> None:
        """A snapshot: `worker` holds exactly `keys`."""
        with self._lock:
            self._drop_locked(worker)
            self._keys[worker] = set()
            for key in keys:
                self._store_locked(worker, key)

    def apply(self, worker: str, keys: Sequence[int], stored: Sequence[bool]) -> None:
        """Events in order: `keys[i]` stored (True) or removed (False) on `worker`."""
        with self._lock:
            self._keys.setdefault(worker, set())
            for key, is_stored in zip(keys, stored, strict=True):
                if is_stored:
                    self._store_locked(worker, key)
                else:
                    self._remove_locked(worker, key)
            self.applied += len(keys)

    def drop(self, worker: str) -> None:
        """`worker` left: forget everything it held."""
        with self._lock:
            self._drop_locked(worker)

    def overlap(self, keys: Sequence[int]) -> dict[str, int]:
        """For each worker that holds the first key: how many of `keys`, from the first, it holds."""
        if not keys:
            return {}
        with self._lock:
            first = self._holders.get(keys[0])
            if not first:
                return {}
            matched = dict.fromkeys(first, 1)
            alive = set(first)
            for depth, key in enumerate(keys[1:], start=2):
                holders = self._holders.get(key)
                alive = alive & holders if holders else set()
                if not alive:
                    break
                for worker in alive:
                    matched[worker] = depth
            return matched

    def _store_locked(self, worker: str, key: int) -> None:
        mine = self._keys[worker]
        if key in mine:
            return
        if self._entries >= self.max_keys:
            self.dropped += 1
            return
        mine.add(key)
        self._holders.setdefault(key, set()).add(worker)
        self._entries += 1

    def _remove_locked(self, worker: str, key: int) -> None:
        mine = self._keys[worker]
        if key not in mine:
            return
        mine.discard(key)
        holders = self._holders[key]
        holders.discard(worker)
        if not holders:
            del self._holders[key]
        self._entries -= 1

    def _drop_locked(self, worker: str) -> None:
        for key in self._keys.pop(worker, ()):
            holders = self._holders[key]
            holders.discard(worker)
            if not holders:
                del self._holders[key]
            self._entries -= 1


class KvEventFeed:
    """One KvEvents.Subscribe stream per worker into a `KvIndex` (see the module doc)."""

    def __init__(
        self,
        index: KvIndex,
        metadata: Sequence[tuple[str, str]] = (),
        channel_of: Callable[[str], grpc.Channel] | None = None,
    ) -> None:
        self.index = index
        self._metadata = tuple(metadata)
        self._channel_of = channel_of
        self._lock = threading.Lock()
        self._subs: dict[str, _Subscription] = {}
        self.resubscribes = 0  # snapshots asked for after a gap, an epoch change or a broken stream

    def watch(self, address: str, channel: grpc.Channel) -> None:
        """Start following `address` (idempotent)."""
        with self._lock:
            if address in self._subs:
                return
            sub = self._subs[address] = _Subscription(self, address, channel)
        sub.start()

    def unwatch(self, address: str) -> None:
        """Stop following `address` and drop its entries."""
        with self._lock:
            sub = self._subs.pop(address, None)
        if sub is not None:
            sub.stop()
        self.index.drop(address)

    def close(self) -> None:
        with self._lock:
            subs, self._subs = list(self._subs.values()), {}
        for sub in subs:
            sub.stop()

    def last_seq(self, address: str) -> int:
        with self._lock:
            sub = self._subs.get(address)
        return sub.last_seq if sub is not None else 0


class _Subscription:
    def __init__(self, feed: KvEventFeed, address: str, channel: grpc.Channel) -> None:
        self._feed = feed
        self._address = address
        self._stub = worker_pb2_grpc.KvEventsStub(channel)
        self._stop = threading.Event()
        self._call: Any = None
        self.epoch = 0
        self.last_seq = 0
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{address}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._call = self._stub.Subscribe(
                    worker_pb2.KvEventsRequest(epoch=self.epoch, after_seq=self.last_seq),
                    metadata=self._feed._metadata or None,
                )
                for batch in self._call:
                    if self._stop.is_set():
                        return
                    if not self._apply(batch):
                        break  # a gap: subscribe again from a snapshot
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    return
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info(
                        "worker %s publishes no KV events (UNIMPLEMENTED): KV-aware routing sees no cache there",
                        self._address,
                    )
                    return
                log.debug("KV events from %s: %s", self._address, exc.code().name)
            finally:
                call, self._call = self._call, None
                if call is not None:
                    call.cancel()
            self._feed.resubscribes += 1
            self._stop.wait(RESUBSCRIBE_S)

    def _apply(self, batch: worker_pb2.KvEventBatch) -> bool:
        index = self._feed.index
        if batch.snapshot:
            index.replace(self._address, batch.keys)
        elif batch.epoch != self.epoch or batch.first_seq != self.last_seq + 1:
            log.info(
                "KV events from %s: gap (epoch %d seq %d after %d seq %d); asking for a snapshot",
                self._address,
                batch.epoch,
                batch.first_seq,
                self.epoch,
                self.last_seq,
            )
            self.epoch, self.last_seq = 0, 0
            return False
        else:
            index.apply(self._address, batch.keys, batch.stored)
        self.epoch, self.last_seq = batch.epoch, batch.last_seq
        return True


def wait_for_index(feed: KvEventFeed, address: str, seq: int, timeout_s: float) -> bool:
    """Test and benchmark aid: wait until the feed applied `address`'s events up to `seq`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if feed.last_seq(address) >= seq:
            return True
        time.sleep(0.01)
    return False
