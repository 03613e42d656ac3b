from __future__ import annotations

import itertools

from kvserve.block_hash import block_identity, hash_block
from kvserve.cache.block_pool import BlockPool
from kvserve.cache.radix_cache import RadixCache

BLOCK = 2


def hashes_of(tokens: list[int]) -> list[bytes]:
    out: list[bytes] = []
    for i in range(len(tokens) // BLOCK):
        out.append(hash_block(out[-1] if out else None, tokens[i * BLOCK : (i + 1) * BLOCK]))
    return out


class Clock:
    def __init__(self) -> None:
        self.ticks = itertools.count()

    def __call__(self) -> float:
        return float(next(self.ticks))


def insert_sequence(tree: RadixCache, pool: BlockPool, tokens: list[int]) -> list[int]:
    """Insert as a finished request would: allocate, insert, release."""
    blocks = pool.allocate(len(tokens) // BLOCK)
    tree.insert(hashes_of(tokens), tokens, blocks)
    pool.release(blocks)
    return blocks


def test_partial_match_splits_node_and_shares_blocks() -> None:
    pool = BlockPool(16)
    tree = RadixCache(BLOCK, pool, clock=Clock())
    a = insert_sequence(tree, pool, [1, 2, 3, 4, 5, 6])
    match = tree.match_prefix(hashes_of([1, 2, 3, 4, 9, 9]), [1, 2, 3, 4, 9, 9], max_blocks=3)
    assert match.block_ids == a[:2]
    assert match.node.block_ids == a[:2] and len(match.node.children) == 1  # split after two blocks
    tree.check_invariants()
    pool.check_invariants()


def test_hash_hit_with_different_tokens_is_a_miss() -> None:
    pool = BlockPool(8)
    tree = RadixCache(BLOCK, pool)
    insert_sequence(tree, pool, [1, 2, 3, 4])
    forged = hashes_of([1, 2, 3, 4])  # right hashes, wrong tokens
    assert tree.match_prefix(forged, [9, 9, 3, 4], max_blocks=2).block_ids == []


def test_eviction_is_lru_and_skips_locked_nodes() -> None:
    pool = BlockPool(16)
    tree = RadixCache(BLOCK, pool, clock=Clock())
    old = insert_sequence(tree, pool, [1, 1, 1, 1])
    locked = insert_sequence(tree, pool, [2, 2, 2, 2])
    new = insert_sequence(tree, pool, [3, 3, 3, 3])
    held = tree.match_prefix(hashes_of([2, 2, 2, 2]), [2, 2, 2, 2], max_blocks=2)
    tree.lock(held.node)
    # Touch [1 1 1 1] after [3 3 3 3] was inserted: [3 3 3 3] is now least recently used.
    tree.match_prefix(hashes_of([1, 1, 1, 1]), [1, 1, 1, 1], max_blocks=2)
    assert tree.evict(2) == 2
    assert not any(pool.cached[b] for b in new)
    assert all(pool.cached[b] for b in old + locked)
    assert tree.evict(10) == 2  # only the old sequence is left unlocked
    assert all(pool.cached[b] for b in locked)
    tree.unlock(held.node)
    assert tree.evict(10) == 2
    assert tree.num_cached_blocks == 0
    tree.check_invariants()
    pool.check_invariants()


def test_eviction_takes_tail_blocks_first_then_parents() -> None:
    pool = BlockPool(16)
    tree = RadixCache(BLOCK, pool, clock=Clock())
    blocks = insert_sequence(tree, pool, [1, 2, 3, 4, 5, 6])
    assert tree.evict(1) == 1
    assert [pool.cached[b] for b in blocks] == [True, True, False]
    match = tree.match_prefix(hashes_of([1, 2, 3, 4, 5, 6]), [1, 2, 3, 4, 5, 6], max_blocks=3)
    assert match.block_ids == blocks[:2]


def test_evicted_and_cached_blocks_carry_the_identity_their_hash_was_made_from() -> None:
    """Across node splits and children, the (parent hash, tokens) reported for a block hash back to it."""
    pool = BlockPool(16)
    tree = RadixCache(BLOCK, pool, clock=Clock())
    sequences = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8, 9, 9], [1, 2, 5, 5]]
    for tokens in sequences:
        insert_sequence(tree, pool, tokens)
    expected = {}
    for tokens in sequences:
        hashes = hashes_of(tokens)
        for i, block_hash in enumerate(hashes):
            expected[block_hash] = block_identity(hashes[i - 1] if i else None, tokens[i * BLOCK : (i + 1) * BLOCK])
    cached = {block_hash: identity for _, block_hash, identity in tree.cached_blocks()}
    assert cached == expected
    evicted: dict[bytes, bytes] = {}
    tree.on_evict = lambda _block_id, block_hash, identity: evicted.__setitem__(block_hash, identity)
    assert tree.evict(16) == len(expected)
    assert evicted == expected
