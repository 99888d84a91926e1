"""The Responses API's stored responses (``store``, ``previous_response_id``, ``GET`` and ``DELETE
/v1/responses/{id}``): a bounded in-memory map on the router, lost when it restarts.

Invariants:
- Bounded twice: at most `max_responses` entries and `max_bytes` of them together (each entry's
  size counts its whole conversation, so the bound holds however much of it entries share); the
  oldest go first. An entry larger than `max_bytes` on its own is not kept.
- A response belongs to the tenant whose token created it: another tenant's look-up finds nothing
  (the same answer as for an id never seen), so ids reveal nothing across tenants.
- Entries are never changed after `put`; a conversation's messages are shared by reference between
  the turns that continue it.
- Used from the router's event loop only (no lock).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pdserve.v1 import common_pb2

MAX_RESPONSES = 1024
MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class StoredResponse:
    """One finished response: its answer object and the conversation that continues from it (every
    turn before it, its own input and its output, instructions left out as OpenAI does)."""

    tenant: str
    answer: dict[str, Any]
    conversation: tuple[common_pb2.ChatMessage, ...]
    size: int  # bytes it accounts for


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES) -> None:
        if max_responses < 1 or max_bytes < 1:
            raise ValueError(f"max_responses and max_bytes must be >= 1, got {max_responses}, {max_bytes}")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def put(
        self,
        response_id: str,
        tenant: str,
        answer: dict[str, Any],
        answer_bytes: int,
        conversation: tuple[common_pb2.ChatMessage, ...],
    ) -> bool:
        """Keep a response (`answer_bytes`: its answer's size as sent); False when it alone exceeds the bound."""
        size = answer_bytes + sum(m.ByteSize() for m in conversation)
        if size > self.max_bytes:
            return False
        replaced = self._entries.pop(response_id, None)  # ids are random: only a bug repeats one
        if replaced is not None:
            self._bytes -= replaced.size
        self._entries[response_id] = StoredResponse(tenant, answer, conversation, size)
        self._bytes += size
        while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
            _, oldest = self._entries.popitem(last=False)
            self._bytes -= oldest.size
        return True

    def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        return entry if entry is not None and entry.tenant == tenant else None

    def delete(self, response_id: str, tenant: str) -> bool:
        entry = self.get(response_id, tenant)
        if entry is None:
            return False
        del self._entries[response_id]
        self._bytes -= entry.size
        return True
