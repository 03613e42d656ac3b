"""Workloads are deterministic per seed, agentic sessions share their prefix, arrivals are Poisson."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import pytest

from kvserve.bench.workloads import (
    Conversation,
    Workload,
    WorkloadConfig,
    agent_system_prompt,
    load_trace,
    parse_mix,
    poisson_arrivals,
    render_plain,
    replay_prompt,
)
from kvserve.errors import InvalidRequest


def take(workload: Workload, n: int) -> list:
    return list(itertools.islice(workload.sessions(), n))


@pytest.mark.parametrize("name", ["agentic", "chat", "mixed", "long-context"])
def test_deterministic_per_seed(name: str) -> None:
    a = take(Workload(WorkloadConfig(name=name, seed=3)), 12)
    b = take(Workload(WorkloadConfig(name=name, seed=3)), 12)
    c = take(Workload(WorkloadConfig(name=name, seed=4)), 12)
    assert a == b
    assert a != c
    # session k does not depend on how many sessions came before it
    assert Workload(WorkloadConfig(name=name, seed=3)).session(7) == a[7]


def test_agentic_sessions_share_the_system_prompt_and_grow_their_prefix() -> None:
    workload = Workload(WorkloadConfig(name="agentic", turns=4, input_len=40, output_len=8))
    sessions = take(workload, 5)
    assert {s.system for s in sessions} == {agent_system_prompt()}
    assert all(len(s.turns) == 4 and all(t.max_tokens == 8 for t in s.turns) for s in sessions)
    for session in sessions:
        conversation = Conversation(session.system)
        previous: list[dict[str, str]] = []
        flat: list[str] = []
        for i, turn in enumerate(session.turns):
            messages = conversation.with_turn(turn.message)
            # every turn resends the whole previous turn (messages and reply) as its prefix
            assert messages[:len(previous)] == previous
            assert len(messages) == 2 + 2 * i
            flat.append(render_plain(messages))
            reply = f"reply {session.session_id}.{i}"
            conversation.append(turn.message, reply)
            previous = messages + [{"role": "assistant", "content": reply}]
        # the flat prompt of the completions endpoint grows by appending too
        for earlier, later in zip(flat, flat[1:], strict=False):
            assert later.startswith(earlier.removesuffix("Assistant:"))
    # first turns differ between sessions
    assert len({s.turns[0].message for s in sessions}) == 5


def test_agent_system_prompt_is_about_1500_tokens_of_json_tools() -> None:
    text = agent_system_prompt()
    schemas = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert len(schemas) >= 8 and all(s["type"] == "function" and "parameters" in s["function"] for s in schemas)
    from tests.support.tiny_models import smollm2_tokenizer

    num_tokens = len(smollm2_tokenizer().encode(text, add_special_tokens=False))
    assert 1300 <= num_tokens <= 1800, num_tokens


def test_chat_requests_share_no_prefix() -> None:
    sessions = take(Workload(WorkloadConfig(name="chat", input_len=64)), 50)
    assert all(len(s.turns) == 1 for s in sessions)
    # distinct system lines from their first word pair on, so no prefix block is shared
    heads = [" ".join(s.system.split()[:2]) + s.turns[0].message[:20] for s in sessions]
    assert len(set(heads)) == len(heads)
    assert len({s.system.split()[0] for s in sessions}) > 25


def test_prompt_lengths_follow_the_config() -> None:
    from tests.support.tiny_models import smollm2_tokenizer

    tok = smollm2_tokenizer()
    chat = Workload(WorkloadConfig(name="chat", input_len=200)).session(0)
    assert 190 <= len(tok.encode(chat.turns[0].message, add_special_tokens=False)) <= 210


def test_long_context_reuses_few_documents() -> None:
    config = WorkloadConfig(name="long-context", num_docs=2, questions_per_doc=4, doc_len=300)
    sessions = take(Workload(config), 16)
    docs = [s.turns[0].message.split("\n\nQuestion:")[0] for s in sessions]
    assert len(set(docs[:8])) == 2 and all(docs[:8].count(d) == 4 for d in set(docs[:8]))
    assert len(set(docs[8:])) == 2 and not set(docs[:8]) & set(docs[8:])  # the next group brings new documents
    assert docs[:4] != [docs[0]] * 4  # questions interleave across documents
    assert len({s.turns[0].message for s in sessions}) == 16


def test_mixed_blend_follows_the_weights() -> None:
    config = WorkloadConfig(name="mixed", mix=parse_mix("agentic=0.8,chat=0.2"))
    kinds = [s.kind for s in take(Workload(config), 400)]
    assert 0.72 < kinds.count("agentic") / 400 < 0.88
    assert Workload(config).mean_turns() == pytest.approx(0.8 * 4 + 0.2)
    with pytest.raises(InvalidRequest):
        parse_mix("agentic")
    with pytest.raises(InvalidRequest):
        WorkloadConfig(name="mixed", mix=(("video", 1.0),))


def test_replay_equal_hash_ids_give_equal_blocks(tmp_path: Path) -> None:
    a = replay_prompt([7, 8, 9], 1200, seed=0).split(" ")
    b = replay_prompt([7, 8, 5], 1100, seed=0).split(" ")
    c = replay_prompt([6, 8], 600, seed=0).split(" ")
    assert len(a) == 1200 and len(b) == 1100 and len(c) == 600
    assert a[:1024] == b[:1024] and a[1024:] != b[1024:1200]
    assert a[512:600] == c[512:600]  # a block's text depends on its id only (Mooncake's ids are chained)
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in [
        {"timestamp": 500, "input_length": 700, "output_length": 3, "hash_ids": [1, 2]},
        {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 3]},
    ]) + "\n")
    records = load_trace(trace)
    assert [r["timestamp"] for r in records] == [0, 500]
    workload = Workload(WorkloadConfig(name="replay", trace=str(trace), time_scale=2.0))
    sessions = list(workload.sessions())
    assert workload.finite_size == 2
    assert [s.arrival_s for s in sessions] == [0.0, 1.0]
    assert [s.turns[0].max_tokens for s in sessions] == [5, 3]
    assert sessions[0].turns[0].message.split(" ")[:512] == sessions[1].turns[0].message.split(" ")[:512]
    trace.write_text('{"timestamp": 1}\n')
    with pytest.raises(InvalidRequest):
        load_trace(trace)


def test_poisson_arrivals_with_a_fixed_seed() -> None:
    times = list(itertools.islice(poisson_arrivals(4.0, seed=11), 4000))
    assert times == list(itertools.islice(poisson_arrivals(4.0, seed=11), 4000))
    assert times != list(itertools.islice(poisson_arrivals(4.0, seed=12), 4000))
    gaps = [b - a for a, b in zip([0.0] + times, times, strict=False)]
    assert all(g > 0 for g in gaps)
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.25, rel=0.05)
    assert statistics.pstdev(gaps) / mean == pytest.approx(1.0, abs=0.07)  # exponential: CV = 1
    # the count in unit windows is Poisson: variance ≈ mean
    counts = [0] * int(times[-1])
    for t in times:
        if int(t) < len(counts):
            counts[int(t)] += 1
    assert statistics.pvariance(counts) / statistics.fmean(counts) == pytest.approx(1.0, abs=0.2)
    assert list(itertools.islice(poisson_arrivals(float("inf"), 0), 3)) == [0.0, 0.0, 0.0]
