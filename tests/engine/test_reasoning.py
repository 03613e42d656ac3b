"""A reasoning model's thoughts told from its answer: in text (the server's splitter) and in token ids (the
runner's gate, with its thinking budget)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.reasoning import (
    AnswerTokens,
    Phase,
    ReasoningGate,
    ReasoningMarkers,
    ReasoningSplitter,
    ReasoningTokens,
    count_reasoning_tokens,
    markers_for,
    phase_after_prompt,
    phase_of_reply,
    split_reasoning,
)

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
    assert char_tokens().phase_after_prompt([ord(c) for c in prompt]) is phase


def test_the_reply_phase_comes_from_the_generation_prompt() -> None:
    """A literal <think> in the conversation says nothing of the reply: only what the generation prompt adds."""
    conversation = "<|im_start|>system\nNever write <think> tags.<|im_end|>\n"
    assert phase_after_prompt(conversation + "<|im_start|>assistant\n", THINK) is Phase.THINKING  # the whole text
    assert phase_of_reply(conversation + "<|im_start|>assistant\n", conversation, THINK) is Phase.OPEN
    assert phase_of_reply(conversation + "<|im_start|>assistant\n<think>\n", conversation, THINK) is Phase.THINKING
    assert phase_of_reply(conversation + "<|im_start|>assistant\nI", None, THINK, continued="I") is Phase.ANSWER
    assert phase_of_reply("x", None, THINK, continued="<think>\nHm") is Phase.THINKING


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
def char_tokens(vocab: dict[int, str] | None = None) -> ReasoningTokens:
    """A vocabulary of one token per character (ids: code points), plus ``vocab``'s longer pieces; the markers
    are written one character a token."""
    pieces = {**(vocab or {})}

    def token_bytes(token_id: int) -> bytes:
        return pieces.get(token_id, chr(token_id)).encode()

    def encode(text: str) -> tuple[int, ...]:
        return tuple(ord(c) for c in text)

    return ReasoningTokens(THINK, encode(THINK.start), encode(THINK.end), token_bytes, encode)


# Pieces a model may write the end marker in that are not how the tokenizer writes it.
OTHER_PIECES = {1000: ".</", 1001: "think", 1002: ">\n\n", 1003: "<think>", 1004: "</think>", 1005: "\n"}
TOKENS = char_tokens(OTHER_PIECES)


def run_gate(gate: ReasoningGate, model_tokens: list[int], steps: int) -> tuple[str, list[int]]:
    """The reply's text after ``steps`` tokens, each the forced one where the gate forces one, else the model's
    next; and the token counts after which the answer began."""
    output, ended, model = [], [], iter(model_tokens)
    for _ in range(steps):
        forced = gate.forced_token
        token = forced if forced is not None else next(model)
        output.append(token)
        if gate.observe(token):
            ended.append(len(output))
    return "".join(TOKENS.token_bytes(t).decode() for t in output), ended


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_gate_forces_the_end_marker_once_the_budget_is_spent() -> None:
    gate = ReasoningGate(TOKENS, Phase.THINKING, budget=3)
    text, ended = run_gate(gate, ids("abcdef"), steps=len("abc</think>de"))
    assert text == "abc</think>de" and ended == [len("abc</think>")] and gate.phase is Phase.ANSWER
    assert count_reasoning_tokens(ids("abc</think>de"), TOKENS, Phase.THINKING) == len("abc</think>")


@pytest.mark.parametrize(("phase", "reply", "answer"), [
    (Phase.THINKING, "ab</think>cd", "cd"),
    (Phase.THINKING, "abc", ""),  # ended in its thoughts
    (Phase.ANSWER, "a<think>b", "a<think>b"),
    (Phase.OPEN, "\n <think>x</think>y", "y"),  # the blanks before the block are the thoughts'
    (Phase.OPEN, "\n <thy", "\n <thy"),  # a start marker begun, then the answer: held, then given
    (Phase.OPEN, "\n <th", "\n <th"),  # ended before choosing: what was held is the answer's
])
def test_answer_tokens_keep_what_comes_with_the_answer_and_hold_the_undecided(
        phase: Phase, reply: str, answer: str) -> None:
    """What a reply's tokens carry (logprob entries), the thoughts' left out, token by token as they stream;
    the same count as count_reasoning_tokens."""
    kept = AnswerTokens(TOKENS, phase)
    sent = [item for token_id in ids(reply) for item in kept.feed(token_id, chr(token_id))] + kept.finish()
    assert "".join(sent) == answer
    assert count_reasoning_tokens(ids(reply), TOKENS, phase) == len(reply) - len(answer)


def test_gate_finishes_an_end_marker_the_model_had_begun() -> None:
    gate = ReasoningGate(TOKENS, Phase.THINKING, budget=4)
    text, ended = run_gate(gate, ids("a</tX"), steps=len("a</think>X"))
    assert text == "a</think>X" and ended == [len("a</think>")]


def test_gate_finds_the_end_in_other_pieces_than_the_tokenizer_writes() -> None:
    """A model may write the marker in pieces of its own (a byte-level BPE joins punctuation and newlines)."""
    gate = ReasoningGate(TOKENS, Phase.THINKING, budget=None)
    text, ended = run_gate(gate, [ord("a"), 1000, 1001, 1002, ord("b")], steps=5)
    assert text == "a.</think>\n\nb" and ended == [4] and gate.forced_token is None
    assert count_reasoning_tokens([ord("a"), 1000, 1001, 1002, ord("b")], TOKENS, Phase.THINKING) == 4


def test_gate_open_phase_thinks_only_when_the_reply_opens_a_block() -> None:
    gate = ReasoningGate(TOKENS, Phase.OPEN, budget=1)
    text, ended = run_gate(gate, [1005, 1003, ord("x"), ord("y")], steps=3 + len("</think>") + 1)
    assert text == "\n<think>x</think>y" and ended == [len([1005, 1003, ord("x")]) + len("</think>")]
    assert count_reasoning_tokens([1005, 1003, ord("x"), 1004, ord("y")], TOKENS, Phase.OPEN) == 4
    answering = ReasoningGate(TOKENS, Phase.OPEN, budget=0)
    text, ended = run_gate(answering, ids("a<think>b"), steps=len("a<think>b"))
    assert text == "a<think>b" and ended == [] and answering.phase is Phase.ANSWER
    assert count_reasoning_tokens(ids("a<think>b"), TOKENS, Phase.OPEN) == 0


def test_a_one_token_end_marker_is_forced_as_that_token() -> None:
    """Where the vocabulary writes </think> as one token (Qwen3, DeepSeek-R1), a budget spent after a thought
    ending in "<" still closes with that token, the one the model was trained to close with."""
    single = ReasoningTokens(THINK, (1003,), (1004,), TOKENS.token_bytes, TOKENS.encode)
    gate = ReasoningGate(single, Phase.THINKING, budget=2)
    output, model = [], iter(ids("x<yz"))
    for _ in range(4):
        token = gate.forced_token if gate.forced_token is not None else next(model)
        output.append(token)
        gate.observe(token)
    assert output == [ord("x"), ord("<"), 1004, ord("y")] and gate.phase is Phase.ANSWER


class FakeMatcher:
    """A grammar matcher that takes every token and remembers them."""

    def __init__(self) -> None:
        self.taken: list[int] = []
        self.version = 0

    def accept(self, token_id: int) -> bool:
        self.taken.append(token_id)
        self.version += 1
        return True


class FakeGrammar:
    def __init__(self) -> None:
        self.matchers: list[FakeMatcher] = []

    def new_matcher(self) -> FakeMatcher:
        self.matchers.append(FakeMatcher())
        return self.matchers[-1]


@pytest.mark.parametrize("replayed", [False, True])
def test_sampling_state_starts_the_grammar_after_the_thoughts(replayed: bool) -> None:
    """OPEN with a one-token start marker: the grammar's matcher follows the reply until it opens a block, then
    nothing does until the block closes, then a fresh matcher takes the answer (live or replayed alike)."""
    from kvserve.runner.sampler import SamplingState
    from kvserve.sampling_params import SamplingParams

    single = ReasoningTokens(THINK, (1003,), (1004,), TOKENS.token_bytes, TOKENS.encode)
    grammar = FakeGrammar()
    state = SamplingState(SamplingParams(), [1], [])
    state.reasoning, state.answer_grammar = ReasoningGate(single, Phase.OPEN), grammar
    state.matcher = grammar.new_matcher()
    assert state.opening_token == 1003
    for token in [1005, 1003, ord("a"), ord("b"), 1004, ord("{"), ord("}")]:
        state.append(token, replayed=replayed)
        if token == 1003:
            assert state.matcher is None and state.opening_token is None
    first, answer = grammar.matchers
    assert first.taken == [1005]  # a blank the grammar allowed, before the reply opened its thoughts
    assert answer.taken == [ord("{"), ord("}")] and state.matcher is answer


def test_budget_zero_closes_the_block_at_once() -> None:
    text, ended = run_gate(ReasoningGate(TOKENS, Phase.THINKING, budget=0), ids("ab"), steps=len("</think>a"))
    assert text == "</think>a" and ended == [len("</think>")]
