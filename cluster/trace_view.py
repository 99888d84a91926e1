"""`pdserve generate --trace`: one line per step-trace event of one request, printed as it arrives.

Each line starts with the client-side time since the request was sent, then the stage, the worker
that did it and what it did. Token pieces are shown as text when their bytes are whole UTF-8, else
as hex bytes (byte-level BPE splits a Chinese character over several tokens).
"""

from __future__ import annotations

import json

from pdserve.v1 import common_pb2, router_pb2

FINISH_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop (EOS or a stop token)",
    common_pb2.FINISH_REASON_LENGTH: "length (max_tokens or the context)",
    common_pb2.FINISH_REASON_STOP_STRING: "stop string",
    common_pb2.FINISH_REASON_CANCELLED: "cancelled",
    common_pb2.FINISH_REASON_ERROR: "error",
}


def piece(raw: bytes) -> str:
    """A token's bytes: quoted text when they are whole UTF-8, else <hex bytes>."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "<" + " ".join(f"{b:02x}" for b in raw) + ">"
    return json.dumps(text, ensure_ascii=False)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def describe(event: common_pb2.TraceEvent) -> tuple[str, str]:
    """(stage, what happened) for one trace event."""
    kind = event.WhichOneof("event")
    if kind == "tokenize":
        e = event.tokenize
        pieces = " ".join(piece(p) for p in e.pieces)
        return "tokenize", f"{len(e.token_ids)} tokens: {pieces}  ({_ms(e.time_s)})"
    if kind == "prefill":
        e = event.prefill
        what = f"pass over {e.num_tokens} prompt tokens, KV {e.kv_len_before} -> {e.kv_len_after}"
        if e.samples:
            what += f", first token {e.first_token_id} {piece(e.first_token_piece)}"
        return "prefill", f"{what}  ({_ms(e.time_s)})"
    if kind == "kv_transfer":
        e = event.kv_transfer
        return "kv hand-off", f"{e.backend}, {e.bytes:,} bytes  ({_ms(e.time_s)})"
    if kind == "decode":
        e = event.decode
        return "decode", f"token {e.token_id} {piece(e.piece)}, KV {e.kv_len}, ITL {_ms(e.itl_s)}"
    if kind == "hold":
        e = event.hold
        return "detok hold", (
            f"token {e.token_id}: {len(e.held)} bytes {piece(e.held)} over {e.held_tokens} "
            f"token(s) wait for the rest of a character"
        )
    if kind == "route":
        e = event.route
        where = f"decode {e.decode_worker}" + (f", prefill {e.prefill_worker}" if e.prefill_worker else "")
        cached = (
            f"; {e.prompt_tokens} prompt tokens, cached {e.decode_cached_tokens} on decode, "
            f"{e.prefill_cached_tokens} on prefill"
            if e.prompt_tokens
            else ""
        )
        return "route", f"{e.decision}: {where}{cached}"
    return "unknown", str(event)


def trace_lines(response: router_pb2.GenerateResponse, elapsed_s: float) -> list[str]:
    """The lines for one response: its events, then the finish reason if it is the last one."""
    stamp = f"{elapsed_s * 1e3:9.1f} ms"
    lines = []
    sampled = [i for i, e in enumerate(response.trace) if e.HasField("decode") or e.prefill.samples]
    for index, event in enumerate(response.trace):
        stage, what = describe(event)
        if sampled and index == sampled[-1]:  # the token this response carries: what text it streamed
            what += f" -> streams {json.dumps(response.text, ensure_ascii=False)}"
        lines.append(f"{stamp}  {stage:<11} {event.worker_id or 'router':<11} {what}")
    if response.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
        reason = FINISH_NAMES.get(response.finish_reason, str(response.finish_reason))
        usage = response.usage
        lines.append(
            f"{stamp}  {'finish':<11} {'':<11} {reason}: {usage.prompt_tokens} prompt + "
            f"{usage.completion_tokens} generated tokens"
        )
    return lines
