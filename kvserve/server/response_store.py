"""Responses kept for the Responses API's ``previous_response_id`` and ``GET`` / ``DELETE /v1/responses/{id}``.

They live in the server process's memory, within a budget (``--response-store-mib``) measured as their JSON:
past it the least recently used response is dropped, and a follow-up naming it is a 400
``previous_response_not_found`` (as OpenAI answers an id it does not hold). A server that restarts holds none.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Turn:
    """One request's input items and its response's output items, after the turns it continued: a chain of
    responses shares its earlier turns instead of each holding a copy of them."""

    items: tuple[dict[str, Any], ...]
    earlier: Turn | None

    def context(self) -> list[dict[str, Any]]:
        """Every turn's items, the first turn's first."""
        turns: list[Turn] = []
        turn: Turn | None = self
        while turn is not None:
            turns.append(turn)
            turn = turn.earlier
        return [item for turn in reversed(turns) for item in turn.items]


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A response as it was answered, the input items its request sent (each with an id), and its turn: the
    items a follow-up continues from are its chain's (``context``)."""

    response: dict[str, Any]
    input_items: tuple[dict[str, Any], ...]
    turn: Turn
    shell_nbytes: int  # the response object without its output items (counted with the turn's items)

    @property
    def context(self) -> list[dict[str, Any]]:
        return self.turn.context()


class ResponseStore:
    """Stored responses by id, the least recently used dropped once their size passes ``max_bytes`` (0: none
    is kept). A chain's responses share the turns before them, so each item counts once, for as long as a
    stored response's chain holds it: a long conversation costs its own size, not that size again for every
    turn. Used from the server's event loop only."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._holders: dict[int, list[int]] = {}  # id() of an item held -> [stored responses holding it, bytes]
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
            previous: StoredResponse | None) -> bool:
        """Keep ``response`` (answered to a request with ``input_items``, following ``previous``), dropping the
        least recently used while the store is over its budget; False where it alone is over the budget (it is
        not kept, and drops none)."""
        output = tuple(item for item in response.get("output") or [] if isinstance(item, dict))
        shell = {key: value for key, value in response.items() if key != "output"}
        turn = Turn((*input_items, *output), previous.turn if previous is not None else None)
        entry = StoredResponse(response, input_items, turn, _json_size(shell))
        context = entry.context
        sizes = [held[1] if (held := self._holders.get(id(item))) else _json_size(item) for item in context]
        if entry.shell_nbytes + sum(sizes) > self.max_bytes:
            return False
        self._drop(response["id"])
        self._entries[response["id"]] = entry
        self._nbytes += entry.shell_nbytes
        for item, size in zip(context, sizes, strict=True):
            held = self._holders.get(id(item))
            if held is None:
                held = self._holders[id(item)] = [0, size]
                self._nbytes += size
            held[0] += 1
        while self._nbytes > self.max_bytes and len(self._entries) > 1:  # the new one fits alone
            self._drop(next(iter(self._entries)))
        return True

    def delete(self, response_id: str) -> bool:
        return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._nbytes -= entry.shell_nbytes
        for item in entry.context:
            held = self._holders[id(item)]
            held[0] -= 1
            if held[0] == 0:
                del self._holders[id(item)]
                self._nbytes -= held[1]
        return True


def _json_size(value: Any) -> int:
    """Its bytes as UTF-8 JSON (escaped, non-ASCII text would count up to three times its size)."""
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass"))
