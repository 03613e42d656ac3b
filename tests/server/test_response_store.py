"""The Responses API's store: the least recently used response dropped past the byte budget, a chain's context
carried from response to response, each item counted once however many responses of the chain hold it."""

from __future__ import annotations

import pytest

from kvserve.server.response_store import ResponseStore
from tests.support.app_calls import post


def _response(response_id: str, text: str) -> dict:
    return {"id": response_id, "object": "response", "output": [
        {"type": "message", "id": f"msg_{response_id}", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": text, "annotations": []}]}]}


def _asked(text: str) -> tuple[dict, ...]:
    return ({"type": "message", "id": f"msg_{text}", "role": "user", "content": [{"type": "input_text", "text": text}]},)


def test_a_chain_carries_every_earlier_turn_and_counts_each_once() -> None:
    store = ResponseStore(max_bytes=10**6)
    assert store.put(_response("r1", "Hello"), _asked("hi"), None)
    after_one = store.nbytes
    assert store.put(_response("r2", "Fine"), _asked("how are you"), store.get("r1"))
    second = store.get("r2")
    assert [item["id"] for item in second.context] == ["msg_hi", "msg_r1", "msg_how are you", "msg_r2"]
    assert second.input_items == _asked("how are you")
    assert store.nbytes < 2 * after_one + 200  # the first turn's items not counted again
    both = store.nbytes
    first_shell = store.get("r1").shell_nbytes
    store.delete("r1")  # its items are the second's earlier turn: still counted, its response object not
    assert store.nbytes == both - first_shell
    store.delete("r2")
    assert store.nbytes == 0 and len(store) == 0


def test_a_long_conversation_costs_its_size_not_its_size_for_every_turn() -> None:
    store = ResponseStore(max_bytes=10**6)
    previous = None
    for turn in range(300):
        assert store.put(_response(f"r{turn}", "x" * 1000), _asked(f"q{turn}"), previous)
        previous = store.get(f"r{turn}")
    assert len(store) == 300 and store.nbytes < 600_000  # ~1.2 KB a turn, once


def test_the_least_recently_used_go_first_and_nothing_is_kept_past_the_budget() -> None:
    probe = ResponseStore(max_bytes=10**6)
    probe.put(_response("r1", "x" * 100), _asked("a1"), None)
    one = probe.nbytes
    store = ResponseStore(max_bytes=2 * one + one // 2)  # room for two
    for response_id in ("r1", "r2"):
        store.put(_response(response_id, "x" * 100), _asked(f"a{response_id}"), None)
    assert store.get("r1") is not None  # now the most recently used
    store.put(_response("r3", "x" * 100), _asked("ar3"), None)
    assert store.get("r2") is None and store.get("r1") is not None and store.get("r3") is not None
    assert not store.put(_response("big", "x" * 10 * one), _asked("a"), None)  # larger than the whole budget
    assert store.get("big") is None and len(store) == 2 and store.nbytes <= store.max_bytes
    assert store.delete("r1") and not store.delete("r1")
    store.delete("r3")
    assert len(store) == 0 and store.nbytes == 0


def test_a_store_of_no_bytes_is_off() -> None:
    assert not ResponseStore(0).enabled and ResponseStore(1).enabled


def test_a_response_larger_than_the_budget_is_answered_as_not_stored(tiny_app) -> None:
    store = tiny_app.state.kvserve.response_store
    budget = store.max_bytes
    body = {"input": "Hello", "max_output_tokens": 2}
    try:
        store.max_bytes = 600  # less than one response object
        status, answer = post(tiny_app, "/v1/responses", body)
        assert status == 200 and answer["store"] is False and store.get(answer["id"]) is None
    finally:
        store.max_bytes = budget
    status, answer = post(tiny_app, "/v1/responses", body)
    assert status == 200 and answer["store"] is True and store.get(answer["id"]) is not None


@pytest.mark.parametrize("with_calls", [False, True])
def test_truncation_auto_keeps_the_latest_items_that_fit(tiny_app, with_calls: bool) -> None:
    """A conversation longer than the context (256 tokens here): a 400 as it is; with ``truncation: "auto"``,
    answered on its latest items that fit from one of its user's messages, the same prompt as sending just
    those items. With parallel calls and their outputs between the turns, no output is kept without its call."""
    items: list[dict] = []
    for i in range(13):
        items.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "many words " * 12})
        if with_calls and i % 2 == 1:
            calls = [f"call_{i}_{j}" for j in range(2)]
            items += [{"type": "function_call", "call_id": c, "name": "f", "arguments": "{}"} for c in calls]
            items += [{"type": "function_call_output", "call_id": c, "output": "ok " * 3} for c in calls]
    body = {"input": items, "max_output_tokens": 2, "store": False}
    status, answer = post(tiny_app, "/v1/responses", body)
    assert status == 400, answer
    status, answer = post(tiny_app, "/v1/responses", {**body, "truncation": "auto"})
    assert status == 200 and answer["truncation"] == "auto", answer
    fitting = []
    for start in reversed([i for i, item in enumerate(items) if item.get("role") == "user"]):
        status, alone = post(tiny_app, "/v1/responses", {**body, "input": items[start:]})
        if status != 200:
            break
        fitting.append(alone["usage"]["input_tokens"])
    assert 1 < len(fitting) < 7 and answer["usage"]["input_tokens"] == fitting[-1]


def test_the_budget_counts_text_as_its_utf8_bytes() -> None:
    """Non-ASCII text counts its UTF-8 bytes, not the six of each character's JSON escape."""
    from kvserve.server.response_store import _json_size

    assert _json_size({"text": "中文 ok"}) == len('{"text":"中文 ok"}'.encode())
