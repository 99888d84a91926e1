"""`pdserve serve --ray --http-port 0` (the real CLI, one process) serves the OpenAI-compatible API:
the official `openai` client lists the model, completes a prompt, chats and uses the Responses API
(a continued conversation too), and /tokenize counts a chat, through the Ray router actor.
Settings that `serve --ray` used to drop (model name, log format, local prefill threshold, prefix
affinity, layer streaming) are given too and the deployment starts with them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("ray")
openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.ray, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def test_serve_ray_http_port_serves_the_openai_api(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("PDSERVE_AUTH_TOKEN", None)
    argv = [
        sys.executable,
        "-m",
        "pdserve.cluster.cli",
        "serve",
        "--ray",
        "--port",
        "0",
        "--http-port",
        "0",
        "--threads-per-worker",
        "1",
        "--kv-cache-mb",
        "64",
        "--device",
        "cpu",
        "--model-name",
        "smol",
        "--log-format",
        "json",
        "--local-prefill-threshold",
        "4",
        "--prefill-policy",
        "prefix_affinity",
        "--decode-policy",
        "prefix_affinity",
        "--kv-streaming",
        "layer",
    ]
    out = tmp_path / "serve.out"
    with out.open("w") as sink:
        serve = subprocess.Popen(
            argv, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 600
        match = None
        while time.monotonic() < deadline and serve.poll() is None:
            match = re.search(r"OpenAI-compatible API: (http://\S+/v1)", out.read_text())
            if match:
                break
            time.sleep(1)
        assert match, f"no HTTP API announced:\n{out.read_text()[-3000:]}"
        client = openai.OpenAI(base_url=match.group(1), api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["smol"]
        completion = client.completions.create(
            model="smol", prompt="The capital of France is", max_tokens=4, temperature=0
        )
        assert completion.choices[0].text and completion.usage.completion_tokens == 4
        chat = client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
        )
        assert chat.choices[0].message.content is not None
        # the Responses API and the tokenizer endpoints: the same HTTP code in the router actor
        answer = client.responses.create(model="smol", input="Hi", max_output_tokens=3, temperature=0)
        assert answer.output_text == chat.choices[0].message.content
        assert answer.usage.input_tokens == chat.usage.prompt_tokens
        follow_up = client.responses.create(
            model="smol", previous_response_id=answer.id, input="And?", max_output_tokens=2
        )
        assert follow_up.usage.input_tokens > answer.usage.input_tokens + answer.usage.output_tokens
        tokenize = urllib.request.Request(
            match.group(1).removesuffix("/v1") + "/tokenize",
            data=json.dumps({"model": "smol", "messages": [{"role": "user", "content": "Hi"}]}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(tokenize, timeout=60) as tokenized:
            assert json.loads(tokenized.read())["count"] == chat.usage.prompt_tokens
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            try:
                serve.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
                serve.wait()
    assert serve.returncode == 0, out.read_text()[-3000:]
