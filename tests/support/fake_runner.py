"""A model-free runner over simulated paged KV memory, for scheduler and cache tests.

It writes each computed token into its slot (block_id * block_size + offset) and samples the next token as
a hash of the tokens it READS BACK through the request's block table. A wrong block table, a block reused
while still live, or a prefix hit on the wrong blocks changes the sampled tokens, so comparing against
``reference_continuation`` checks the whole KV bookkeeping without a model.

Tier transfers work as in the real runner, offloads first, then loads, then the "forward": a block's
fake KV payload is the bytes of its (position, token) slots, so loading the wrong payload (or into the
wrong block, or after the block was overwritten) changes the tokens read back, hence the output.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable

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


EMPTY_SLOT = (-1, -1)


def payload_nbytes(block_size: int) -> int:
    return 8 * block_size


def noisy_drafts(tokens: list[int], num_drafts: int = 4) -> list[int]:
    """Drafts for speculative-decoding tests: the true continuation, cut short or wrong from a position
    that depends on the history (0..num_drafts: all drafts right), so steps accept 0..all of them."""
    true = reference_continuation(tokens, num_drafts)
    wrong_at = len(tokens) * 7 % (num_drafts + 1)
    if wrong_at < num_drafts:
        true[wrong_at] = (true[wrong_at] + 1) % VOCAB
    return true


class FakeRunner:
    """``propose``: with it, the runner offers drafts (speculative decoding) and verifies scheduled ones as the
    real runner does: the token after each accepted draft is read back through the block table too."""

    def __init__(self, num_blocks: int, block_size: int,
                 propose: Callable[[list[int]], list[int]] | None = None) -> None:
        self.block_size = block_size
        self.propose = propose
        self.num_drafts_verified = 0
        self.num_drafts_accepted = 0
        self.slots: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)  # (position, token)
        self.num_computed_tokens = 0
        self.num_blocks_loaded = 0
        self.num_blocks_offloaded = 0

    def read_block(self, block_id: int) -> bytes:
        bs = self.block_size
        pairs = [slot or EMPTY_SLOT for slot in self.slots[block_id * bs : (block_id + 1) * bs]]
        return struct.pack(f"<{2 * bs}i", *(x for pair in pairs for x in pair))

    def write_block(self, block_id: int, payload: bytes) -> None:
        bs = self.block_size
        values = struct.unpack(f"<{2 * bs}i", payload)
        for i in range(bs):
            pair = (values[2 * i], values[2 * i + 1])
            self.slots[block_id * bs + i] = None if pair == EMPTY_SLOT else pair

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        result = RunnerOutput()
        result.offloaded = [(block_hash, self.read_block(block_id)) for block_id, block_hash in out.kv_offloads]
        for block_id, payload in out.kv_loads:
            self.write_block(block_id, payload)
        self.num_blocks_offloaded += len(out.kv_offloads)
        self.num_blocks_loaded += len(out.kv_loads)
        bs = self.block_size
        # Like every layer of the real forward: the whole step's KV is written before anything is read, so a
        # request may read blocks another request of the same step fills.
        for s in out.scheduled:
            for i, token in enumerate(s.token_ids + s.draft_token_ids):
                pos = s.start_position + i
                self.slots[s.block_ids[pos // bs] * bs + pos % bs] = (pos, token)
            self.num_computed_tokens += len(s.token_ids)
        for s in out.scheduled:
            if s.sample:
                end = s.start_position + len(s.token_ids)
                seen = [self._read(s.block_ids, pos) for pos in range(end)]
                token = next_token(seen)
                num_accepted = 0
                for draft in s.draft_token_ids:
                    if token != draft:
                        break
                    seen.append(self._read(s.block_ids, end + num_accepted))
                    num_accepted += 1
                    token = next_token(seen)
                result.sampled_token_ids[s.request_id] = token
                if s.draft_token_ids:
                    result.num_accepted_drafts[s.request_id] = num_accepted
                    self.num_drafts_verified += len(s.draft_token_ids)
                    self.num_drafts_accepted += num_accepted
                if self.propose is not None:
                    result.draft_token_ids[s.request_id] = self.propose(seen + [token])
        return result

    def _read(self, block_ids: list[int], pos: int) -> int:
        bs = self.block_size
        entry = self.slots[block_ids[pos // bs] * bs + pos % bs]
        assert entry is not None and entry[0] == pos, f"slot for position {pos} holds {entry}"
        return entry[1]
