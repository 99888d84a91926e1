"""The pass log (PDSERVE_PASS_LOG): one line per pass of a real engine, with the pass's shape as
the simulated engine counts it, and a reader that refuses what is not a pass log."""

from __future__ import annotations

import math

import pytest

from pdserve.engine.pass_log import COLUMNS, ENV_VAR, PassLog, read_pass_logs
from pdserve.engine.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def test_no_log_unless_the_variable_names_a_folder(monkeypatch, tiny_llama, make_engine) -> None:  # noqa: ANN001
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert PassLog.from_env() is None
    assert make_engine(tiny_llama).pass_log is None
    monkeypatch.setenv(ENV_VAR, "")
    assert PassLog.from_env() is None


def test_every_pass_is_logged_with_its_shape(monkeypatch, tmp_path, tiny_llama, make_engine) -> None:  # noqa: ANN001
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "log"))
    engine = make_engine(tiny_llama, prefill_chunk_tokens=16)
    engine.scheduler.attention_crossover = math.inf  # plain 16-token chunks beside the stream (test_chunk_cost.py)
    engine.add_request("short", [5, 6, 7], PARAMS)
    engine.step()  # prompt of 3 tokens alone
    engine.add_request("long", list(range(100, 140)), PARAMS)  # 40 tokens: chunks of 16, 16, 8
    expected = [(0, 0, 3, 9)]
    while engine.has_work:
        cached = {seq.request_id: seq.num_cached for seq in engine.sequences.values()}
        engine.step()
        planned = engine.last_pass
        if planned is None or not planned.items:
            continue
        decode = [i for i in planned.items if not i.is_prefill]
        prefill = [i for i in planned.items if i.is_prefill]
        expected.append(
            (
                len(decode),
                sum(cached[i.seq.request_id] + 1 for i in decode),
                sum(len(i.token_ids) for i in prefill),
                sum(len(i.token_ids) * (cached[i.seq.request_id] + len(i.token_ids)) for i in prefill),
            )
        )
    engine.pass_log.close()
    files = list((tmp_path / "log").glob("passes-*.csv"))
    assert len(files) == 1
    rows = read_pass_logs(files)
    got = [
        (int(r["decode_batch"]), int(r["decode_context"]), int(r["prefill_tokens"]), int(r["prefill_attention"]))
        for r in rows
    ]
    assert got == expected
    # the long prompt's chunks rode along with the short one's decode steps: mixed passes
    assert got[1:4] == [(1, 4, 16, 256), (1, 5, 16, 16 * 32), (1, 6, 8, 8 * 40)]
    assert all(r["seconds"] > 0 for r in rows)
    assert [r["start_s"] for r in rows] == sorted(r["start_s"] for r in rows)


def test_reader_refuses_other_files_and_keeps_a_cut_last_line(tmp_path) -> None:  # noqa: ANN001
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not a pass log"):
        read_pass_logs([other])
    log = tmp_path / "passes-1-0.csv"
    log.write_text(",".join(COLUMNS) + "\n1.0,0.5,2,40,0,0\n2.0,0.5,2,42,16,256\n3.0,0.")
    assert [r["decode_context"] for r in read_pass_logs([log])] == [40, 42]  # a killed worker's last line
    log.write_text(",".join(COLUMNS) + "\n1.0,0.5,2\n2.0,0.5,2,42,16,256\n")
    with pytest.raises(ValueError, match=r"passes-1-0.csv:2: expected 6 fields"):
        read_pass_logs([log])
