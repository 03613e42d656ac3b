"""A reasoning model's thoughts told from its answer: in text (the server's splitter) and in token ids (the
runner's gate, with its thinking budget)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.reasoning import (
    Phase,
    ReasoningMarkers,
    ReasoningSplitter,
    ReasoningTokens,
    count_reasoning_tokens,
    markers_for,
    phase_after_prompt,
    split_reasoning,
)
from kvserve.runner.reasoning_gate import ReasoningGate

THINK = ReasoningMarkers()
QWEN3_TEMPLATE = "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}</think>"


@pytest.mark.parametrize(("prompt", "phase"), [
    ("<|im_start|>assistant\n<think>\n", Phase.THINKING),  # DeepSeek-R1's distills open the block themselves
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", Phase.ANSWER),  # Qwen3 with enable_thinking false
    ("<|im_start|>assistant\n", Phase.OPEN),  # Qwen3's hybrid models decide themselves
    # an earlier turn's thoughts, closed: the new reply is free to think again
    ("<think>a</think>b<|im_end|>\n<|im_start|>assistant\n", Phase.OPEN),
    ("<think>a</think>b<|im_end|>\n<|im_start|>assistant\n<think>", Phase.THINKING),
])
def test_phase_after_prompt_text_and_ids(prompt: str, phase: Phase) -> None:
    assert phase_after_prompt(prompt, THINK) is phase
    # the same on token ids, one id per character (the markers several tokens long)
    tokens = ReasoningTokens(tuple(map(ord, THINK.start)), tuple(map(ord, THINK.end)),
                             lambda ids: not "".join(map(chr, ids)).strip())
    assert tokens.phase_after_prompt([ord(c) for c in prompt]) is phase


def test_markers_for() -> None:
    assert markers_for("auto", QWEN3_TEMPLATE) == THINK
    assert markers_for("auto", "{{ messages }}") is None
    assert markers_for("auto", None) is None
    assert markers_for("none", QWEN3_TEMPLATE) is None
    assert markers_for("deepseek_r1", None) == THINK


@pytest.mark.parametrize(("text", "phase", "expected"), [
    ("\nI add them.\n</think>\n\nIt is 4.", Phase.THINKING, ("I add them.", "It is 4.")),
    ("<think>\nhmm\n\n</think>\n\nYes.", Phase.OPEN, ("hmm", "Yes.")),
    ("  <think>x</think>y", Phase.OPEN, ("x", "y")),
    ("Yes, <think> is a tag.", Phase.OPEN, (None, "Yes, <think> is a tag.")),
    ("<think>x</think>y", Phase.ANSWER, (None, "<think>x</think>y")),
    ("thinking until the end", Phase.THINKING, ("thinking until the end", "")),  # cut off by max_tokens
    ("a </thin", Phase.THINKING, ("a </thin", "")),  # a marker's beginning, never finished: thought
    ("<thi", Phase.OPEN, (None, "<thi")),
    ("", Phase.THINKING, ("", "")),
    ("a\n\n b </think>", Phase.THINKING, ("a\n\n b", "")),
])
def test_split_reasoning(text: str, phase: Phase, expected: tuple[str | None, str]) -> None:
    assert split_reasoning(text, THINK, phase) == expected


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "<th", "ink>", "</", "\n", " ", "a", "b c", ">", "<"]),
                max_size=12),
       st.sampled_from(list(Phase)), st.data())
def test_streamed_pieces_give_the_whole_split(pieces: list[str], phase: Phase, data: st.DataObject) -> None:
    """However the text is cut into streamed pieces, the pieces' parts join up to the whole text's parts."""
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    splitter = ReasoningSplitter(THINK, phase)
    reasoning, content = [], []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        r, c = splitter.feed(text[a:b])
        reasoning.append(r)
        content.append(c)
    r, c = splitter.finish()
    whole_reasoning, whole_content = split_reasoning(text, THINK, phase)
    assert "".join(content) + c == whole_content
    assert "".join(reasoning) + r == (whole_reasoning or "")
    assert splitter.reasoning_seen == (whole_reasoning is not None)


# --- token ids: the runner's gate --------------------------------------------------------------------------
START, END = (7,), (8, 9)  # an end marker of two tokens, as a vocabulary without a </think> token writes it
TOKENS = ReasoningTokens(START, END, lambda ids: all(t == 0 for t in ids))


def run_gate(gate: ReasoningGate, model_tokens: list[int], steps: int) -> tuple[list[int], list[int]]:
    """The output of ``steps`` tokens, each the forced one where the gate forces one, else the model's next;
    and the positions after which the answer began."""
    output, ended, model = [], [], iter(model_tokens)
    for _ in range(steps):
        forced = gate.forced_token
        token = forced if forced is not None else next(model)
        output.append(token)
        if gate.observe(token):
            ended.append(len(output))
    return output, ended


def test_gate_forces_the_end_marker_once_the_budget_is_spent() -> None:
    gate = ReasoningGate(TOKENS, Phase.THINKING, budget=3)
    output, ended = run_gate(gate, [1, 2, 3, 4, 5, 6], steps=7)
    assert output == [1, 2, 3, 8, 9, 4, 5]
    assert ended == [5] and gate.phase is Phase.ANSWER
    assert count_reasoning_tokens(output, TOKENS, Phase.THINKING) == 5


def test_gate_finishes_an_end_marker_the_model_had_begun() -> None:
    gate = ReasoningGate(TOKENS, Phase.THINKING, budget=2)
    output, ended = run_gate(gate, [1, 8, 5], steps=4)
    assert output == [1, 8, 9, 5] and ended == [3]


def test_gate_without_budget_and_the_natural_end() -> None:
    gate = ReasoningGate(TOKENS, Phase.THINKING, budget=None)
    output, ended = run_gate(gate, [1, 8, 1, 8, 8, 9, 2], steps=7)
    assert ended == [6] and gate.forced_token is None


def test_gate_open_phase_thinks_only_when_the_output_opens_a_block() -> None:
    gate = ReasoningGate(TOKENS, Phase.OPEN, budget=1)
    output, ended = run_gate(gate, [7, 1, 2], steps=5)
    assert output == [7, 1, 8, 9, 2] and ended == [4]
    assert count_reasoning_tokens(output, TOKENS, Phase.OPEN) == 4
    answering = ReasoningGate(TOKENS, Phase.OPEN, budget=0)
    output, ended = run_gate(answering, [1, 7, 2], steps=3)
    assert output == [1, 7, 2] and ended == [] and answering.phase is Phase.ANSWER
    assert count_reasoning_tokens(output, TOKENS, Phase.OPEN) == 0


def test_budget_zero_closes_the_block_at_once() -> None:
    output, ended = run_gate(ReasoningGate(TOKENS, Phase.THINKING, budget=0), [1, 2], steps=3)
    assert output == [8, 9, 1] and ended == [2]
