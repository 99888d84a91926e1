"""DecodeWorker.GenerateMux end to end over a real loopback grpc.aio server: the worker side
(`decode_worker/mux.py`, serving a scripted Generate) against the router side (`router/mux.py`).

Each request reads like its own Generate call: responses in order then EOF, the status a Generate
call would end with, cancellation and deadlines reaching the worker's Generate, and the call's
failure failing every request on it. The tokens of one tick cross in one message."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from pdserve.decode_worker.mux import serve_mux
from pdserve.router.mux import DecodeMux
from pdserve.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc


class ScriptedDecode(worker_pb2_grpc.DecodeWorkerServicer):
    """Generate by prompt: "ok:N" streams N tokens, one per 20 ms tick (all streams in step);
    "abort" ends RESOURCE_EXHAUSTED; "boom" raises; "hang" waits forever (until cancelled)."""

    def __init__(self) -> None:
        self.ended: dict[str, str] = {}  # request id -> how its Generate ended
        self.remaining: dict[str, float | None] = {}  # request id -> deadline the worker saw

    async def Generate(self, request: worker_pb2.DecodeRequest, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        rid = request.request_id
        self.remaining[rid] = context.time_remaining()
        how = "returned"
        try:
            if request.prompt == "abort":
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room")
            if request.prompt == "boom":
                raise RuntimeError("step broke")
            if request.prompt == "hang":
                await asyncio.sleep(3600)
            n = int(request.prompt.split(":")[1])
            loop = asyncio.get_running_loop()
            for i in range(n):
                await asyncio.sleep(0.02 - loop.time() % 0.02)  # every stream wakes on the same tick
                last = i == n - 1
                yield router_pb2.GenerateResponse(
                    request_id=rid,
                    text=f"t{i} ",
                    token_ids=[i],
                    finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0,
                )
        except asyncio.CancelledError:
            how = "cancelled"
            raise
        except BaseException as exc:
            how = type(exc).__name__
            raise
        finally:
            self.ended[rid] = how

    async def GenerateMux(self, request_iterator: Any, context: Any) -> None:  # noqa: N802
        await serve_mux(self.Generate, request_iterator, context)


def _run(body: Callable[[DecodeMux, ScriptedDecode, grpc.aio.Server], Any]) -> Any:
    async def main() -> Any:
        servicer = ScriptedDecode()
        server = grpc.aio.server()
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        closed: list[DecodeMux] = []
        mux = DecodeMux(f"127.0.0.1:{port}", worker_pb2_grpc.DecodeWorkerStub(channel), (), closed.append)
        try:
            return await asyncio.wait_for(body(mux, servicer, server), timeout=30)
        finally:
            await mux.close()
            await channel.close()
            await server.stop(None)

    return asyncio.run(main())


def _request(rid: str, prompt: str) -> worker_pb2.DecodeRequest:
    return worker_pb2.DecodeRequest(request_id=rid, prompt=prompt)


async def _read_all(call: Any) -> list[Any]:  # noqa: ANN401
    out = []
    while (response := await call.read()) is not grpc.aio.EOF:
        out.append(response)
    return out


def test_many_requests_stream_in_order_and_a_tick_crosses_in_one_message() -> None:
    async def body(mux: DecodeMux, servicer: ScriptedDecode, server: Any) -> None:
        calls = [mux.open(_request(f"r{i}", "ok:6"), 20.0) for i in range(32)]
        results = await asyncio.gather(*(_read_all(c) for c in calls))
        for i, responses in enumerate(results):
            assert [r.text for r in responses] == [f"t{k} " for k in range(6)]
            assert {r.request_id for r in responses} == {f"r{i}"}
            assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert set(servicer.ended.values()) == {"returned"}
        # 192 responses + 32 end items; the streams tick together, so a message carries many
        assert mux.messages_received < 192 / 4, mux.messages_received
        assert mux.open_requests == 0
        assert 19 < servicer.remaining["r0"] <= 20.0  # the worker got the deadline

    _run(body)


def test_statuses_pass_through_and_other_requests_are_untouched() -> None:
    async def body(mux: DecodeMux, servicer: ScriptedDecode, server: Any) -> None:
        ok = mux.open(_request("fine", "ok:4"), 20.0)
        aborted = mux.open(_request("full", "abort"), 20.0)
        broken = mux.open(_request("broke", "boom"), 20.0)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await aborted.read()
        assert (err.value.code(), err.value.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "no room")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await broken.read()
        assert err.value.code() == grpc.StatusCode.UNKNOWN and "step broke" in err.value.details()
        assert [r.text for r in await _read_all(ok)] == ["t0 ", "t1 ", "t2 ", "t3 "]

    _run(body)


def test_duplicate_id_on_one_stream_is_dropped_and_the_first_completes(caplog: pytest.LogCaptureFixture) -> None:
    async def body(mux: DecodeMux, servicer: ScriptedDecode, server: Any) -> None:
        first = mux.open(_request("same", "ok:3"), 20.0)
        # a second open with the same id goes straight to the wire (the router never does this:
        # its ids are fresh uuids); the worker drops it without touching the first
        mux._outgoing.put_nowait(worker_pb2.MuxRequest(open=worker_pb2.MuxOpen(request=_request("same", "ok:9"))))
        responses = await _read_all(first)
        assert [r.text for r in responses] == ["t0 ", "t1 ", "t2 "]
        assert list(servicer.ended) == ["same"]  # one Generate ran

    _run(body)
    assert "request id same is already open on this stream" in caplog.text


def test_cancel_reaches_the_workers_generate_and_a_deadline_ends_with_deadline_exceeded() -> None:
    async def body(mux: DecodeMux, servicer: ScriptedDecode, server: Any) -> None:
        hung = mux.open(_request("hung", "hang"), 20.0)
        late = mux.open(_request("late", "hang"), 0.3)
        other = mux.open(_request("other", "ok:10"), 20.0)
        await other.read()  # everything is open at the worker
        assert hung.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await late.read()
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for _ in range(100):
            if servicer.ended.get("hung") and servicer.ended.get("late"):
                break
            await asyncio.sleep(0.02)
        assert servicer.ended["hung"] == servicer.ended["late"] == "cancelled"
        assert len(await _read_all(other)) == 9  # the stream beside them went on
        assert not hung.cancel()  # idempotent

    _run(body)


def test_the_call_failing_fails_every_open_request_with_unavailable() -> None:
    async def body(mux: DecodeMux, servicer: ScriptedDecode, server: Any) -> None:
        calls = [mux.open(_request(f"h{i}", "hang"), 20.0) for i in range(5)]
        while len(servicer.remaining) < 5:
            await asyncio.sleep(0.01)
        await server.stop(None)  # the worker goes away
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert mux.closed
        late = mux.open(_request("after", "ok:1"), 5.0)  # raced with the end: fails the same way
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await late.read()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    _run(body)
