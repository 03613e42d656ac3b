"""Random insert / match / lock / unlock / evict sequences against a naive model of the prefix cache.

The naive model is a set of cached prefixes (tuples of tokens, block-aligned) and the set of sequences
finished requests computed (what a partly filled tail may hold). After every operation: the pool and
tree invariants hold; a lookup finds exactly the longest cached prefix the model predicts, plus the
longest start of a tail the tree keeps after it; every tail holds what some finished request computed,
and a finished request leaves one; eviction removes only prefixes no running request uses, and never a
prefix while keeping its extension. The pool's free / used / evictable counts match the model's own
count of the blocks live requests hold (recorded when each was admitted) and the blocks the tree holds.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvserve.cache.kv_manager import KVCacheManager
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 24
token_lists = st.lists(st.integers(0, 2), min_size=1, max_size=22)


def make_request(rid: int, tokens: list[int]) -> Request:
    return Request(f"r{rid}", tokens, SamplingParams(max_tokens=1), max_total_tokens=len(tokens) + 1)


def tree_tails(kv: KVCacheManager) -> set[tuple[int, ...]]:
    """The sequence each tail holds KV for: its node's prefix, then its own tokens."""
    out: set[tuple[int, ...]] = set()
    stack = [(kv.prefix_cache.tree.root, ())]
    while stack:
        node, prefix = stack.pop()
        full = prefix + tuple(node.token_ids)
        out.update(full + tail.token_ids for tail in node.tails)
        stack.extend((child, full) for child in node.children.values())
    return out


def common_start(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def tree_block_ids(kv: KVCacheManager) -> set[int]:
    """Every block the tree holds: the full blocks of its nodes and the blocks of its tails."""
    out: set[int] = set()
    stack = [kv.prefix_cache.tree.root]
    while stack:
        node = stack.pop()
        out.update(node.block_ids)
        out.update(tail.block_id for tail in node.tails)
        stack.extend(node.children.values())
    return out


def tree_prefixes(kv: KVCacheManager) -> set[tuple[int, ...]]:
    """Every block-aligned prefix the tree holds."""
    out: set[tuple[int, ...]] = set()
    stack = [(kv.prefix_cache.tree.root, ())]
    while stack:
        node, prefix = stack.pop()
        for i in range(len(node.block_ids)):
            out.add(prefix + tuple(node.token_ids[: (i + 1) * BLOCK]))
        full = prefix + tuple(node.token_ids)
        stack.extend((child, full) for child in node.children.values())
    return out


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK, enable_prefix_caching=True)
        self.model: set[tuple[int, ...]] = set()
        self.computed: set[tuple[int, ...]] = set()  # what finished requests computed
        self.running: dict[int, Request] = {}
        self.held: dict[int, list[int]] = {}  # the blocks each running request was given when admitted
        self.next_id = 0

    def expected_blocks(self, tokens: list[int]) -> int:
        max_blocks = (len(tokens) - 1) // BLOCK
        n = 0
        while n < max_blocks and tuple(tokens[: (n + 1) * BLOCK]) in self.model:
            n += 1
        return n * BLOCK

    def expected_match(self, tokens: list[int]) -> int:
        """Full blocks, then the longest start a kept tail after them shares (leaving the last token)."""
        full = self.expected_blocks(tokens)
        rest = tokens[full : len(tokens) - 1]
        tails = [t[full:] for t in tree_tails(self.kv) if len(t) // BLOCK == full // BLOCK and list(t[:full]) == tokens[:full]]
        return full + max((common_start(t, rest) for t in tails), default=0)

    @rule(tokens=token_lists)
    def admit(self, tokens: list[int]) -> None:
        """lookup + allocate + compute everything + insert: a request that prefilled and keeps running."""
        request = make_request(self.next_id, tokens)
        self.next_id += 1
        assert self.kv.cached_prefix_length(request) == self.expected_blocks(tokens)  # tails not counted
        expected = self.expected_match(tokens)
        hit = self.kv.lookup(request)
        assert hit.num_tokens == expected
        if not self.kv.allocate(request, request.num_tokens - hit.num_tokens, hit):
            self.kv.release_hit(hit)
            self.sync_after_eviction()
            return
        self.sync_after_eviction()
        request.num_computed_tokens = request.num_tokens
        self.kv.cache_blocks(request)
        for i in range(1, len(tokens) // BLOCK + 1):
            self.model.add(tuple(tokens[: i * BLOCK]))
        self.running[int(request.request_id[1:])] = request
        self.held[int(request.request_id[1:])] = list(request.block_ids)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.running)))
        request = self.running.pop(key)
        del self.held[key]
        computed = tuple(request.all_token_ids[: request.num_computed_tokens])
        self.kv.free(request)
        if len(computed) % BLOCK:
            self.computed.add(computed)
            assert any(t[: len(computed)] == computed for t in tree_tails(self.kv)), "the tail was not kept"

    @rule(n=st.integers(1, NUM_BLOCKS))
    def evict(self, n: int) -> None:
        evictable = self.kv.prefix_cache.tree.num_evictable_blocks()
        evicted = self.kv.prefix_cache.tree.evict(n)
        assert evicted == min(n, evictable)
        self.sync_after_eviction()

    @rule(tokens=token_lists)
    def match_only(self, tokens: list[int]) -> None:
        request = make_request(-1, tokens)
        expected = self.expected_match(tokens)
        tails = tree_tails(self.kv)
        hit = self.kv.lookup(request)
        assert hit.num_tokens == expected
        self.kv.release_hit(hit)
        assert tree_tails(self.kv) == tails, "a lookup given back changed the tails"

    def sync_after_eviction(self) -> None:
        now = tree_prefixes(self.kv)
        assert now <= self.model, "the tree holds a prefix nobody inserted"
        removed = self.model - now
        in_use = {tuple(r.all_token_ids[: i * BLOCK]) for r in self.running.values()
                  for i in range(1, r.num_tokens // BLOCK + 1)}
        assert not removed & in_use, "evicted a prefix a running request uses"
        for prefix in now:
            for k in range(BLOCK, len(prefix), BLOCK):
                assert prefix[:k] in now, "kept a prefix whose parent was evicted"
        self.model = now
        assert all(any(c[: len(t)] == t for c in self.computed) for t in tree_tails(self.kv)), (
            "a tail holds tokens no finished request computed")

    @invariant()
    def invariants_hold(self) -> None:
        self.kv.check_invariants()
        pool = self.kv.pool
        assert pool.num_free + pool.num_used + pool.num_evictable == NUM_BLOCKS
        for request in self.running.values():
            assert all(pool.ref_counts[b] > 0 for b in request.block_ids)
        # The model's own count (no lookup is outstanding between operations): a block is used while a running
        # request holds it, evictable while only the tree does, free otherwise.
        holders = Counter(b for blocks in self.held.values() for b in blocks)
        used = set(holders)
        cached = tree_block_ids(self.kv)
        assert pool.num_used == len(used), f"pool counts {pool.num_used} used blocks, requests hold {len(used)}"
        assert pool.num_evictable == len(cached - used), (
            f"pool counts {pool.num_evictable} evictable blocks, the tree alone holds {len(cached - used)}")
        assert pool.num_free == NUM_BLOCKS - len(used | cached), (
            f"pool counts {pool.num_free} free blocks, nobody holds {NUM_BLOCKS - len(used | cached)}")
        assert self.kv.num_cached_blocks == len(cached)
        assert [pool.ref_counts[b] for b in range(NUM_BLOCKS)] == [holders[b] for b in range(NUM_BLOCKS)], (
            "a block's reference count differs from the number of running requests holding it")


PrefixCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPrefixCache = PrefixCacheMachine.TestCase
