"""The router's admission queue: requests wait for a decode slot (FCFS within a priority, retries
first) and are refused only when the bounded queue is full or the predicted wait exceeds the
request's deadline."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from router_fakes import FakeDecode, FakePrefill

from pdserve.router.admission import AdmissionQueue, Busy, QueueFull
from pdserve.router.config import RouterConfig
from pdserve.v1 import common_pb2, router_pb2


class Slots:
    """`assign` callables over a fixed number of slots; leases are slot tokens."""

    def __init__(self, n: int) -> None:
        self.free = n
        self.order: list[str] = []

    def assign(self, name: str):  # noqa: ANN201
        def take() -> str:
            if self.free == 0:
                raise Busy("full")
            self.free -= 1
            self.order.append(name)
            return name

        return take


def run(coro):  # noqa: ANN001, ANN201
    return asyncio.run(coro)


def test_waiters_are_admitted_by_priority_then_arrival_and_retries_first() -> None:
    async def scenario() -> list[str]:
        slots = Slots(0)
        queue: AdmissionQueue[str] = AdmissionQueue(10, release=lambda _: None)
        tasks = [
            asyncio.create_task(queue.acquire(slots.assign(name), priority=prio, retry=retry))
            for name, prio, retry in (("a", 0, False), ("b", 5, False), ("c", 0, False), ("d", 0, True))
        ]
        await asyncio.sleep(0.01)
        assert len(queue) == 4
        for _ in range(4):
            slots.free += 1
            queue.wake()
        await asyncio.gather(*tasks)
        return slots.order

    assert run(scenario()) == ["d", "b", "a", "c"]


def test_head_of_line_is_never_overtaken_and_cancelled_waiters_are_skipped() -> None:
    async def scenario() -> tuple[list[str], int]:
        slots = Slots(0)
        queue: AdmissionQueue[str] = AdmissionQueue(10, release=lambda _: None)
        first = asyncio.create_task(queue.acquire(slots.assign("first")))
        gone = asyncio.create_task(queue.acquire(slots.assign("gone")))
        last = asyncio.create_task(queue.acquire(slots.assign("last")))
        await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.sleep(0.01)
        slots.free = 2
        queue.wake()
        await asyncio.gather(first, last)
        return slots.order, len(queue)

    order, left = run(scenario())
    assert order == ["first", "last"] and left == 0


def test_the_predicted_wait_follows_the_pace_at_which_the_queue_moved() -> None:
    """Once a backlogged queue has let requests go, its predicted wait is the measured interval
    between departures per request ahead, whatever the service-time model said."""
    from pdserve.router.admission import MIN_PACE_SAMPLES

    async def scenario() -> tuple[float, float, float]:
        slots = Slots(0)
        queue: AdmissionQueue[str] = AdmissionQueue(100, release=lambda _: None)
        queue.finished(10.0, 1)  # the service-time model: 10 s per request, one at a time
        waiting = [asyncio.create_task(queue.acquire(slots.assign(f"r{i}"))) for i in range(MIN_PACE_SAMPLES + 6)]
        await asyncio.sleep(0.01)
        before = queue.predicted_wait_s()
        for _ in range(MIN_PACE_SAMPLES + 1):  # one departure every 20 ms while others wait
            slots.free += 1
            queue.wake()
            await asyncio.sleep(0.02)
        ahead = len(queue)
        after = queue.predicted_wait_s()
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        return before, after, after / (ahead + 1)

    before, after, pace = run(scenario())
    assert before > 100  # 15 ahead at 10 s each, one at a time
    assert 0.015 < pace < 0.2, pace  # the measured 20 ms per departure (a loaded machine sleeps longer)
    assert after < 5


def test_a_full_queue_refuses_at_once_with_a_retry_hint() -> None:
    async def scenario() -> QueueFull:
        slots = Slots(0)
        queue: AdmissionQueue[str] = AdmissionQueue(2, release=lambda _: None)
        waiting = [asyncio.create_task(queue.acquire(slots.assign(str(i)))) for i in range(2)]
        await asyncio.sleep(0.01)
        with pytest.raises(QueueFull) as refused:
            await queue.acquire(slots.assign("third"))
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        return refused.value

    refused = run(scenario())
    assert "queue full" in str(refused) and refused.retry_after_s >= 1


def test_a_request_that_cannot_be_served_before_its_deadline_is_refused() -> None:
    async def scenario() -> None:
        slots = Slots(0)
        queue: AdmissionQueue[str] = AdmissionQueue(100, release=lambda _: None)
        queue.finished(service_time_s=10.0, slots=1)  # each request holds the only slot ~10 s
        waiting = asyncio.create_task(queue.acquire(slots.assign("w")))
        await asyncio.sleep(0.01)
        assert queue.predicted_wait_s() == pytest.approx(20.0)
        with pytest.raises(QueueFull, match="deadline"):
            await queue.acquire(slots.assign("late"), deadline_s=5.0)
        slots.free = 1
        queue.wake()  # a request with enough time still queues and is served
        assert await waiting == "w"

    run(scenario())


def test_a_lease_granted_to_a_waiter_that_just_left_is_released() -> None:
    async def scenario() -> list[str]:
        released: list[str] = []
        slots = Slots(0)
        queue: AdmissionQueue[str] = AdmissionQueue(10, release=released.append)
        task = asyncio.create_task(queue.acquire(slots.assign("x")))
        await asyncio.sleep(0.01)
        slots.free = 1
        queue.wake()  # grants the lease ...
        task.cancel()  # ... in the same tick the client leaves
        await asyncio.gather(task, return_exceptions=True)
        return released

    assert run(scenario()) == ["x"]


class HoldingDecode(FakeDecode):
    """Streams one token, then holds the stream open until `release` is set; reports 1 slot."""

    def __init__(self) -> None:
        super().__init__(info=common_pb2.WorkerInfo(healthy=True, max_running_requests=1))
        self.release = threading.Event()
        self.open = 0
        self._lock = threading.Lock()

    def Generate(self, request, context):  # noqa: ANN001, ANN201, N802
        with self._lock:
            self.open += 1
        self.requests.append(request)
        yield router_pb2.GenerateResponse(text="x", token_ids=[1])
        self.release.wait(30)
        yield router_pb2.GenerateResponse(
            text="y",
            token_ids=[2],
            finish_reason=common_pb2.FINISH_REASON_LENGTH,
            usage=common_pb2.Usage(prompt_tokens=1, completion_tokens=2),
        )


def _consume(stub, request_id: str = "", priority: int = 0, timeout: float = 60):  # noqa: ANN001, ANN202
    request = router_pb2.GenerateRequest(request_id=request_id, prompt="hi", priority=priority)
    return list(stub.Generate(request, timeout=timeout))


def test_router_queues_beyond_worker_slots_instead_of_refusing(fake_server, start_router) -> None:  # noqa: ANN001
    decode = HoldingDecode()
    server, stub = start_router(
        RouterConfig(prefill=(fake_server(FakePrefill()),), decode=(fake_server(decode),), poll_interval_s=0.1)
    )
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_consume, stub, f"r{i}") for i in range(8)]
        deadline = time.monotonic() + 20
        while stub.GetStatus(router_pb2.StatusRequest(), timeout=5).queued_requests < 5:
            assert time.monotonic() < deadline, "requests were not queued"
            time.sleep(0.05)
        status = stub.GetStatus(router_pb2.StatusRequest(), timeout=5)
        assert decode.open == 3  # 1 slot + 2 prefilling allowance (router.worker_pool.slots_of)
        assert status.max_queued_requests == 4096 and status.in_flight_requests == 8
        decode.release.set()
        results = [f.result(timeout=60) for f in futures]
    assert all(r[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH for r in results)
    assert sorted(r[0].request_id for r in results) == sorted(f"r{i}" for i in range(8))
    status = stub.GetStatus(router_pb2.StatusRequest(), timeout=5)
    assert status.queued_requests == 0 and status.dequeued_requests == 8 and status.queue_time_s_sum > 0


def test_router_refuses_with_retry_after_only_when_its_queue_is_full(fake_server, start_router) -> None:  # noqa: ANN001
    decode = HoldingDecode()
    _server, stub = start_router(
        RouterConfig(prefill=(fake_server(FakePrefill()),), decode=(fake_server(decode),), max_queued_requests=2)
    )
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(_consume, stub) for _ in range(5)]  # 3 at the worker, 2 queued
        deadline = time.monotonic() + 20
        while stub.GetStatus(router_pb2.StatusRequest(), timeout=5).queued_requests < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        call = stub.Generate(router_pb2.GenerateRequest(prompt="one too many"), timeout=10)
        with pytest.raises(grpc.RpcError) as refused:
            list(call)
        decode.release.set()
        assert all(f.result(timeout=60)[-1].finish_reason for f in futures)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "queue full" in refused.value.details()
    assert int(dict(refused.value.trailing_metadata())["retry-after"]) >= 1


def test_duplicate_client_ids_get_distinct_internal_ids(fake_server, start_router) -> None:  # noqa: ANN001
    decode = FakeDecode()
    _server, stub = start_router(RouterConfig(prefill=(fake_server(FakePrefill()),), decode=(fake_server(decode),)))
    first, second = _consume(stub, "dup1"), _consume(stub, "dup1")
    assert first[0].request_id == second[0].request_id == "dup1"  # the client's label is echoed
    internal = [r.request_id for r in decode.requests]
    assert len(set(internal)) == 2 and "dup1" not in internal  # workers key on the router's ids
    assert [r.client_request_id for r in decode.requests] == ["dup1", "dup1"]


class FailingDecode(FakeDecode):
    """Fails every request with `code` (a request that breaks this worker's step, or a dead worker)."""

    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__()
        self.code = code

    def Generate(self, request, context):  # noqa: ANN001, ANN201, N802
        self.requests.append(request)
        context.abort(self.code, "decode step failed: poison")
        yield  # pragma: no cover


def test_a_poison_request_fails_after_two_workers_and_suspects_nobody(fake_server, start_router) -> None:  # noqa: ANN001
    workers = [FailingDecode(grpc.StatusCode.INTERNAL) for _ in range(3)]
    _server, stub = start_router(
        RouterConfig(
            prefill=(fake_server(FakePrefill()),), decode=tuple(fake_server(w) for w in workers), max_attempts=3
        )
    )
    with pytest.raises(grpc.RpcError) as failed:
        _consume(stub)
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert "same way on two workers" in failed.value.details()
    assert sum(len(w.requests) for w in workers) == 2  # not retried across the whole pool
    status = stub.GetStatus(router_pb2.StatusRequest(), timeout=5)
    assert all(w.healthy for w in status.workers)  # nobody marked suspect


def test_a_request_fault_on_one_worker_is_retried_on_another(fake_server, start_router) -> None:  # noqa: ANN001
    bad, good = FailingDecode(grpc.StatusCode.INTERNAL), FakeDecode()
    _server, stub = start_router(
        RouterConfig(prefill=(fake_server(FakePrefill()),), decode=(fake_server(bad), fake_server(good)))
    )
    results = [_consume(stub) for _ in range(2)]  # round robin: each starts on `bad`, then moves on
    assert all("".join(r.text for r in res) == "Hello world" for res in results)
    assert len(bad.requests) == 2 and len(good.requests) == 2  # `bad` was not suspected: it kept its turn


def test_slo_admission_refuses_at_once_what_would_miss_its_ttft(fake_server, start_router) -> None:  # noqa: ANN001
    """The router learns the prefill rate from first tokens; once a prefill worker reports a backlog
    that the rate says takes longer than the SLO, a new request is refused with a retry-after hint
    before any worker sees it, a best-effort one is still served, and the refusal is counted. The
    worker's first token takes a known 50 ms, so every TTFT the model learns is at least that: a
    per-request SLO of 1 ms is below its prediction with or without a backlog."""
    from waiting import eventually

    first_token_s = 0.05
    prefill, decode = FakePrefill(), FakeDecode(first_token_delay_s=first_token_s)
    _server, stub = start_router(
        RouterConfig(
            prefill=(fake_server(prefill),), decode=(fake_server(decode),), poll_interval_s=0.05, slo_ttft_s=2.0
        )
    )
    for i in range(6):  # teach the TTFT model (no backlog: every TTFT, >= 50 ms, is well within the SLO)
        responses = list(stub.Generate(router_pb2.GenerateRequest(prompt=f"warm {i}"), timeout=10))
        assert responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    prefill.info.queued_prompt_tokens = 10**9  # a huge backlog: no rate learned here fits it in 2 s

    def sees_backlog() -> bool:
        status = stub.GetStatus(router_pb2.StatusRequest(), timeout=5)
        return any(w.queued_prompt_tokens == 10**9 for w in status.workers)

    eventually(sees_backlog, 10)
    seen = len(decode.requests)
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(router_pb2.GenerateRequest(prompt="on time or not at all"), timeout=10))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "exceeds the SLO" in refused.value.details()
    assert int(dict(refused.value.trailing_metadata())["retry-after"]) >= 1
    assert len(decode.requests) == seen  # refused before any worker did anything for it
    served = list(stub.Generate(router_pb2.GenerateRequest(prompt="whenever", best_effort=True), timeout=10))
    assert served[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    tight = router_pb2.GenerateRequest(prompt="per-request SLO", slo_ttft_ms=1)
    prefill.info.queued_prompt_tokens = 0
    eventually(lambda: not sees_backlog(), 10)
    seen = len(decode.requests)
    # even without a backlog, 1 ms is below the prediction: every first token took >= 50 ms, so the
    # learned rate (per 64 tokens of work at least) and the worker's recent TTFT are both >= 45 ms
    with pytest.raises(grpc.RpcError) as per_request:
        list(stub.Generate(tight, timeout=10))
    assert per_request.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "exceeds the SLO" in per_request.value.details()
    assert len(decode.requests) == seen  # refused at admission too
    assert stub.GetStatus(router_pb2.StatusRequest(), timeout=5).slo_shed_requests == 2


def test_slo_admission_serves_what_it_queued_instead_of_refusing_it_after_the_wait(  # noqa: ANN001
    fake_server, start_router
) -> None:
    """A refusal comes at once or not at all: a request that passed the check before queueing is
    dispatched when a slot frees, even if the prediction has since turned against it, and the
    next new request is refused at once."""
    from concurrent.futures import ThreadPoolExecutor

    from waiting import eventually

    prefill, decode = FakePrefill(), HoldingDecode()
    _server, stub = start_router(
        RouterConfig(
            prefill=(fake_server(prefill),), decode=(fake_server(decode),), poll_interval_s=0.05, slo_ttft_s=2.0
        )
    )
    decode.release.set()
    for i in range(6):  # teach the TTFT model
        assert _consume(stub, f"warm{i}")[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    decode.release.clear()
    with ThreadPoolExecutor(4) as pool:
        holding = [pool.submit(_consume, stub, f"hold{i}") for i in range(3)]  # the worker's 3 places
        eventually(lambda: decode.open == 9, 20)
        waiting = pool.submit(_consume, stub, "queued")
        eventually(lambda: stub.GetStatus(router_pb2.StatusRequest(), timeout=5).queued_requests == 1, 20)
        prefill.info.queued_prompt_tokens = 10**9  # now nothing fits the SLO any more
        eventually(
            lambda: any(
                w.queued_prompt_tokens == 10**9 for w in stub.GetStatus(router_pb2.StatusRequest(), timeout=5).workers
            ),
            10,
        )
        decode.release.set()
        assert waiting.result(timeout=60)[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert all(f.result(timeout=60)[-1].finish_reason for f in holding)
    assert stub.GetStatus(router_pb2.StatusRequest(), timeout=5).slo_shed_requests == 0
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as refused:  # a new request meets the backlog before it waits
        _consume(stub, "late")
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() - started < 5
    assert stub.GetStatus(router_pb2.StatusRequest(), timeout=5).slo_shed_requests == 1


def test_ttft_model_uses_a_workers_recent_ttft_and_forgets_it() -> None:
    from pdserve.router.slo import MIN_SAMPLES, RECENT_S, TtftModel

    model = TtftModel()
    for _ in range(MIN_SAMPLES):
        model.observe(0.01, 1000, "w1", now=0.0)  # 10 us per token, learned on w1
    assert model.ready and abs(model.predict(1000, "w2", now=0.0) - 0.01) < 1e-9
    for _ in range(20):  # w2's last first tokens took 2 s: a long backlog there (the rate stays 10 us)
        model.observe(2.0, 200_000, "w2", now=1.0)
    assert model.predict(100, "w2", now=1.5) > 1.5  # recent TTFT there, not 100 tokens' worth (1 ms)
    assert model.predict(100, "w2", now=1.0 + RECENT_S + 0.1) < 1.0  # forgotten without news
    assert model.predict(100, "w1", now=1.5) < 1.0  # the other worker is not affected


def test_calibration_is_the_90th_percentile_of_how_far_ttfts_ran_over_their_prediction() -> None:
    from pdserve.router.slo import MIN_CALIBRATION_SAMPLES, Calibration

    calibration = Calibration()
    for _ in range(MIN_CALIBRATION_SAMPLES - 1):
        calibration.observe(0.1, 0.3)
    assert calibration.factor == 1.0  # too few outcomes to act on
    for i in range(100):  # actual / predicted: 1.00, 1.02, ... 2.98 (and the 3.0s above)
        calibration.observe(0.1, 0.1 * (1 + i / 50))
    assert 2.7 < calibration.factor <= 3.0
    for _ in range(256):  # predictions that now hold: the old outcomes are forgotten
        calibration.observe(0.1, 0.05)
    assert calibration.factor == 0.5


def test_ttft_model_best_is_the_best_worker_for_the_prompt_now() -> None:
    from pdserve.router.slo import MIN_SAMPLES, RECENT_S, TtftModel

    model = TtftModel()
    for _ in range(MIN_SAMPLES):
        model.observe(0.001, 1000, "", now=0.0)  # 1 us per token of prefill work
    assert model.best({}, 500) == 0.0  # nobody to predict for
    # w1 is idle but its last first tokens took 0.5 s; w2 has 100,000 tokens queued (0.1 s)
    model.observe(0.5, 500_000, "w1", now=0.0)  # the same rate, behind a long backlog then
    backlogs = {"w1": 0, "w2": 100_000}
    assert abs(model.best(backlogs, 1000, now=0.1) - 0.101) < 1e-9  # w2: its backlog plus this prompt
    assert abs(model.best(backlogs, 1000, now=RECENT_S + 0.1) - 0.001) < 1e-9  # w1's slow past forgotten


def test_http_requests_carry_their_own_slo_and_priority_class(fake_server, start_router) -> None:  # noqa: ANN001
    """On HTTP, `slo_ttft_ms` sets a request's own TTFT objective (a 1 ms one is refused at once with
    429 and Retry-After), `best_effort` exempts it, and bad values are 400s naming the field. The
    worker's first token takes a known 50 ms, so the TTFT the router predicts is well above 1 ms."""
    import json
    import urllib.error
    import urllib.request

    decode = FakeDecode(first_token_delay_s=0.05)
    server, stub = start_router(
        RouterConfig(prefill=(fake_server(FakePrefill()),), decode=(fake_server(decode),), http_port=0, model_name="m")
    )

    def post(extra: dict[str, object]) -> tuple[int, dict[str, str], dict[str, object]]:
        body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2, **extra}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{server.http_port}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return answer.status, dict(answer.headers), json.loads(answer.read())
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), json.loads(error.read())

    for i in range(6):  # teach the TTFT model; no deployment SLO, so nothing is refused meanwhile
        list(stub.Generate(router_pb2.GenerateRequest(prompt=f"warm {i}"), timeout=10))
    assert post({})[0] == 200
    seen = len(decode.requests)
    status, headers, body = post({"slo_ttft_ms": 1})  # below the prediction (every TTFT took >= 50 ms)
    assert status == 429 and int(headers["Retry-After"]) >= 1, body
    assert "exceeds the SLO" in body["error"]["message"]
    assert len(decode.requests) == seen  # refused before any worker saw it
    status, _, body = post({"slo_ttft_ms": 1, "best_effort": True, "priority": 5})
    assert status == 200 and body["choices"][0]["text"], body
    assert decode.requests[-1].prompt == "hi"
    assert post({"slo_ttft_ms": 60_000})[0] == 200  # a loose objective is met
    assert stub.GetStatus(router_pb2.StatusRequest(), timeout=5).slo_shed_requests == 1
    for field, value in (
        ("slo_ttft_ms", -1),
        ("slo_ttft_ms", "fast"),
        ("slo_ttft_ms", 1.5),
        ("slo_ttft_ms", 10**12),
        ("best_effort", "yes"),
        ("priority", 101),
        ("priority", True),
    ):
        status, _, body = post({field: value})
        assert status == 400 and body["error"]["param"] == field, (field, value, body)
    from pdserve.router.openai_protocol import CHAT, parse_request

    parsed = parse_request(
        CHAT,
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "priority": -3,
            "slo_ttft_ms": 250,
            "best_effort": True,
        },
        "m",
        "r1",
    ).grpc_request
    assert (parsed.priority, parsed.slo_ttft_ms, parsed.best_effort) == (-3, 250, True)
