"""A model-free runner over simulated paged KV memory, for scheduler and cache tests.

It writes each computed token into its slot (block_id * block_size + offset) and samples the next token as
a hash of the tokens it READS BACK through the request's block table. A wrong block table, a block reused
while still live, or a prefix hit on the wrong blocks changes the sampled tokens, so comparing against
``reference_continuation`` checks the whole KV bookkeeping without a model.
"""

from __future__ import annotations

import hashlib

from kvserve.batch import RunnerOutput, SchedulerOutput

VOCAB = 50


def next_token(tokens: list[int]) -> int:
    digest = hashlib.blake2b(bytes(str(tokens), "ascii"), digest_size=4).digest()
    return int.from_bytes(digest, "little") % VOCAB


def reference_continuation(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)  # (position, token)
        self.num_computed_tokens = 0

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        result = RunnerOutput()
        bs = self.block_size
        for s in out.scheduled:
            for i, token in enumerate(s.token_ids):
                pos = s.start_position + i
                self.slots[s.block_ids[pos // bs] * bs + pos % bs] = (pos, token)
            self.num_computed_tokens += len(s.token_ids)
            if s.sample:
                end = s.start_position + len(s.token_ids)
                seen = []
                for pos in range(end):
                    entry = self.slots[s.block_ids[pos // bs] * bs + pos % bs]
                    assert entry is not None and entry[0] == pos, f"slot for position {pos} holds {entry}"
                    seen.append(entry[1])
                result.sampled_token_ids[s.request_id] = next_token(seen)
        return result
