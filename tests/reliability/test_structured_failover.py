"""Structured outputs survive the request moving: 24 `json_schema` requests at temperature 1.0 on the
default model, 1 prefill + 2 decode workers, while requests are live-migrated between the decode
workers and one decode worker is then killed (SIGKILL). Every answer parses and validates against
the schema: the grammar state is rebuilt from the tokens on whichever worker goes on (the prefill
worker's first token, a migration target, a failover target), and nothing else crosses.

24 requests (it was 50) still give every path its cases: about 12 per decode worker, 8 or more
mid-stream before up to 6 are migrated, and the victim dies holding 2 or more; the other 26 only
added decode work on the default model."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest
from injection import injected

from pdserve.cluster.launch import LaunchOptions, local_deployment
from pdserve.cluster.local import LocalCluster
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

from e2e_helpers import wait_idle, worker_info

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "population_millions": {"type": "number"},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population_millions", "capital"],
    "additionalProperties": False,
}
N = 24


def _request(i: int) -> router_pb2.GenerateRequest:
    request = router_pb2.GenerateRequest(
        request_id=f"json-{i}",
        params=common_pb2.SamplingParams(
            max_tokens=64,
            temperature=1.0,
            seed=i,
            structured=common_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA)),
        ),
    )
    request.messages.messages.add(role="user", content=f"Describe a European city as JSON ({i}).")
    return request


def test_json_schema_outputs_hold_through_migration_and_failover(default_model_dir) -> None:  # noqa: ANN001
    config = local_deployment(prefill=1, decode=2, threads_per_worker=1)
    options = LaunchOptions(decode_args=("--kv-timeout-s", "30"))
    with injected(step_delay_ms=40), LocalCluster(config, options) as cluster:
        stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router_address))
        texts: dict[int, str] = {}
        tokens: dict[int, int] = {}  # tokens seen so far per request
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                parts = []
                for response in stub.Generate(_request(i), timeout=600):
                    parts.append(response.text)
                    tokens[i] = tokens.get(i, 0) + len(response.token_ids)
                    if response.finish_reason:
                        assert response.finish_reason == common_pb2.FINISH_REASON_STOP, response
                texts[i] = "".join(parts)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(N)]
        for thread in threads:
            thread.start()
        decoders = [w for w in cluster.workers if w.role == "decode"]
        deadline = time.monotonic() + 300
        while sum(1 for count in tokens.values() if count >= 3) < 8:  # several requests mid-stream
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(0.05)

        def migrate(i: int) -> bool:
            try:
                stub.Migrate(router_pb2.MigrateRequest(request_id=f"json-{i}"), timeout=60)
                return True
            except grpc.RpcError as exc:  # it finished meanwhile, or is not decoding yet
                assert exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION), exc
                return False

        # the 6 mid-stream requests furthest from done, all at once: moved one after another on a
        # loaded machine, the later ones finished while the first ones moved
        live = sorted((count, i) for i, count in list(tokens.items()) if count >= 3 and i not in texts)[:6]
        with ThreadPoolExecutor(len(live)) as pool:
            moved = sum(pool.map(migrate, [i for _, i in live]))
        assert moved >= 2
        victim = max(decoders, key=lambda w: worker_info(w.address, "decode").running_requests)
        assert worker_info(victim.address, "decode").running_requests >= 2  # it dies holding requests
        os.kill(victim.pid, signal.SIGKILL)
        for thread in threads:
            thread.join(600)
        assert not errors, errors[:3]
        assert len(texts) == N
        for text in texts.values():
            jsonschema.validate(json.loads(text), SCHEMA)
        wait_idle([(w.role, w.address) for w in cluster.workers if w.pid != victim.pid])
