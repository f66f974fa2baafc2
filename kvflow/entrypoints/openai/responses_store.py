"""The Responses API's stored responses: a bounded in-memory LRU for
``GET /v1/responses/{id}`` and ``previous_response_id``.

Each entry keeps the response object and the conversation it ends (chat messages, its
own input and output included, its instructions not: OpenAI does not carry those over),
so a follow-up request renders the whole conversation again; the prefix cache finds the
earlier turns' KV. Bounded in entries (--responses-store-size) and in characters, least
recently used out first; nothing is written to disk and a restart forgets everything.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

# All entries together stay under this many characters of JSON (about as many bytes),
# whatever the entry count: a store of long conversations cannot grow the server without
# bound.
MAX_STORE_CHARS = 256 << 20


@dataclass(frozen=True)
class StoredResponse:
    response: dict
    """The response object as the API returned it."""
    messages: list[dict]
    """The conversation up to and including this response's output, as chat messages."""
    size: int


class ResponseStore:
    def __init__(self, max_entries: int, max_chars: int = MAX_STORE_CHARS) -> None:
        self.max_entries = max_entries
        self.max_chars = max_chars
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def put(self, response_id: str, response: dict, messages: list[dict]) -> None:
        if not self.enabled:
            return
        size = len(json.dumps(response)) + len(json.dumps(messages))
        if size > self.max_chars:
            return
        self.delete(response_id)
        self._entries[response_id] = StoredResponse(response, messages, size)
        self._chars += size
        while len(self._entries) > self.max_entries or self._chars > self.max_chars:
            _, old = self._entries.popitem(last=False)
            self._chars -= old.size

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._chars -= entry.size
        return True
