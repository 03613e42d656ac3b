"""Responses kept for the Responses API's ``previous_response_id`` and ``GET`` / ``DELETE /v1/responses/{id}``.

They live in the server process's memory, within a byte budget (``--response-store-mib``): past it the least
recently used response is dropped, and a follow-up naming it is a 400 ``previous_response_not_found`` (as
OpenAI answers an id it does not hold). A server that restarts holds none.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A response as it was answered, the input items its request sent (each with an id), and the items a
    follow-up continues from: the earlier turns' items, this request's input, this response's output."""

    response: dict[str, Any]
    input_items: tuple[dict[str, Any], ...]
    context: tuple[dict[str, Any], ...]
    context_nbytes: int  # the context's items as JSON: a chain's earlier turns counted again in each response

    @property
    def nbytes(self) -> int:
        return self.context_nbytes + _json_size(self.response)


class ResponseStore:
    """Stored responses by id, the least recently used dropped once their size passes ``max_bytes`` (0: none
    is kept). Used from the server's event loop only."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._nbytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, response: dict[str, Any], input_items: tuple[dict[str, Any], ...],
            previous: StoredResponse | None) -> StoredResponse:
        """Keep ``response`` (answered to a request with ``input_items``, following ``previous``); older ones
        are dropped while the store is over its budget. One larger than the whole budget is not kept (and
        drops none)."""
        earlier = previous.context if previous is not None else ()
        output = tuple(item for item in response.get("output") or [] if isinstance(item, dict))
        own = input_items + output
        entry = StoredResponse(response, input_items, earlier + own,
                               (previous.context_nbytes if previous is not None else 0) + sum(map(_json_size, own)))
        self._drop(response["id"])
        if entry.nbytes > self.max_bytes:
            return entry
        self._entries[response["id"]] = entry
        self._nbytes += entry.nbytes
        while self._nbytes > self.max_bytes and self._entries:
            self._drop(next(iter(self._entries)))
        return entry

    def delete(self, response_id: str) -> bool:
        return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._nbytes -= entry.nbytes
        return True


def _json_size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":")))
