"""One request's place in its thoughts, token by token: where its answer (and its grammar) begins, and the
end marker forced once its thinking budget is spent (``thinking_token_budget``, vLLM's; llama.cpp's
``--reasoning-budget``)."""

from __future__ import annotations

from kvserve.reasoning import Phase, ReasoningTokens


class ReasoningGate:
    """Follows a request's output tokens through its reasoning block (see kvserve.reasoning)."""

    __slots__ = ("_tokens", "phase", "budget", "num_thought_tokens", "_matched")

    def __init__(self, tokens: ReasoningTokens, phase: Phase, budget: int | None) -> None:
        self._tokens = tokens
        self.phase = phase
        self.budget = budget  # thought tokens before the end marker is forced (None: no limit)
        self.num_thought_tokens = 0
        # OPEN: tokens of the start marker the output began with; THINKING: of the end marker the output ends with
        self._matched = 0

    @property
    def forced_token(self) -> int | None:
        """The token the next step must take (the end marker's next, once the budget is spent), or None."""
        if self.phase is not Phase.THINKING or self.budget is None or self.num_thought_tokens < self.budget:
            return None
        return self._tokens.end_ids[self._matched]  # an end marker the model had begun is finished, not restarted

    def observe(self, token_id: int) -> bool:
        """A token joins the output; True when it closed the block (the answer starts with the next token)."""
        tokens = self._tokens
        if self.phase is Phase.OPEN:
            if token_id == tokens.start_ids[self._matched]:
                self._matched += 1
                if self._matched == len(tokens.start_ids):
                    self.phase, self._matched = Phase.THINKING, 0
            else:
                self.phase = Phase.ANSWER
            return False
        if self.phase is not Phase.THINKING:
            return False
        self.num_thought_tokens += 1
        end = tokens.end_ids
        if token_id == end[self._matched]:
            self._matched += 1
        else:  # a false start of the marker may itself begin it again
            self._matched = 1 if token_id == end[0] else 0
        if self._matched == len(end):
            self.phase, self._matched = Phase.ANSWER, 0
            return True
        return False
