"""The draft model's KV bookkeeping (cache/draft_kv.py): what it keeps across steps, rolls back, shares and
frees."""

from __future__ import annotations

from kvserve.cache.draft_kv import DraftKVCache

BLOCK = 4


def test_first_sight_computes_everything_then_only_what_is_new() -> None:
    kv = DraftKVCache(num_blocks=16, block_size=BLOCK, hash_extra=b"draft")
    tokens = list(range(10))
    slots = kv.prepare("a", tokens, num_ahead=2)
    assert slots is not None and slots.num_computed == 0
    assert len(slots.block_ids) == 3  # 10 tokens + 2 ahead
    kv.computed("a", [100, 101])  # drafts 100, 101 fed back in; a third draft was proposed after them
    # The target accepted 100, then sampled 7: KV is kept up to and including 100.
    slots = kv.prepare("a", [*tokens, 100, 7], num_ahead=2)
    assert slots is not None and slots.num_computed == 11
    kv.check_invariants()


def test_all_drafts_accepted_keeps_all_of_the_draft_kv() -> None:
    kv = DraftKVCache(num_blocks=16, block_size=BLOCK, hash_extra=b"draft")
    tokens = list(range(6))
    kv.prepare("a", tokens, num_ahead=2)
    kv.computed("a", [50, 51])
    slots = kv.prepare("a", [*tokens, 50, 51, 52, 9], num_ahead=2)  # 50, 51, 52 accepted, then 9
    assert slots is not None and slots.num_computed == 8  # up to 51; 52 (never fed) and 9 are computed next


def test_a_shared_prompt_is_computed_once() -> None:
    kv = DraftKVCache(num_blocks=32, block_size=BLOCK, hash_extra=b"draft")
    prompt = list(range(100, 113))  # 3 full blocks and one token
    kv.prepare("a", prompt, num_ahead=1)
    kv.computed("a", [])
    slots = kv.prepare("b", [*prompt[:12], 999], num_ahead=1)  # same first 12 tokens: 3 blocks from the cache
    assert slots is not None and slots.num_computed == 12
    assert kv.num_cached_tokens == 12
    kv.check_invariants()


def test_a_salted_prompt_shares_its_blocks_only_with_prompts_of_its_salt() -> None:
    kv = DraftKVCache(num_blocks=32, block_size=BLOCK, hash_extra=b"draft")
    prompt = list(range(100, 113))
    kv.prepare("a", prompt, num_ahead=1, salt="tenant-1")
    kv.computed("a", [])
    assert kv.tokens_to_compute("b", prompt) == kv.tokens_to_compute("c", prompt, "tenant-2") == 13
    assert kv.tokens_to_compute("d", prompt, "tenant-1") == 1
    unsalted = kv.prepare("e", prompt, num_ahead=1)
    salted = kv.prepare("f", prompt, num_ahead=1, salt="tenant-1")
    assert unsalted is not None and salted is not None
    assert (unsalted.num_computed, salted.num_computed) == (0, 12)
    kv.check_invariants()


def test_tokens_to_compute_counts_what_the_prefix_cache_lacks_and_changes_nothing() -> None:
    kv = DraftKVCache(num_blocks=32, block_size=BLOCK, hash_extra=b"draft")
    prompt = list(range(100, 113))  # 3 full blocks and one token
    assert kv.tokens_to_compute("a", prompt) == 13  # nothing cached yet
    kv.prepare("a", prompt, num_ahead=1)
    kv.computed("a", [])
    kv.check_invariants()
    free_before = kv.kv.pool.num_free
    assert kv.tokens_to_compute("b", [*prompt[:12], 999]) == 1  # three blocks cached: only its own token
    assert kv.tokens_to_compute("c", [*prompt[:6], 7, 7, 7]) == 5  # one block cached
    assert kv.tokens_to_compute("d", prompt[:8]) == 4  # the last token is always computed (its logits)
    assert kv.tokens_to_compute("e", [5, 5, 5, 5, 5]) == 5
    assert kv.kv.pool.num_free == free_before and not kv.holds("b")
    slots = kv.prepare("b", [*prompt[:12], 999], num_ahead=1)  # what the count promised
    assert slots is not None and slots.num_computed == 12
    kv.check_invariants()


def test_unconfirmed_drafts_never_enter_the_prefix_cache() -> None:
    kv = DraftKVCache(num_blocks=32, block_size=BLOCK, hash_extra=b"draft")
    prompt = list(range(6))
    kv.prepare("a", prompt, num_ahead=3)
    kv.computed("a", [60, 61])  # fill the second block with drafts the target never confirmed
    kv.release("a")
    # A request whose tokens continue with the drafts finds the confirmed tokens in the cache (a full block and
    # the kept tail of the next), not the drafts.
    slots = kv.prepare("b", [*prompt, 60, 61, 5, 5], num_ahead=1)
    assert slots is not None and slots.num_computed == len(prompt)
    kv.check_invariants()


def test_a_full_pool_gives_no_slots_and_changes_nothing() -> None:
    kv = DraftKVCache(num_blocks=4, block_size=BLOCK, hash_extra=b"draft")
    assert kv.prepare("a", list(range(12)), num_ahead=1) is not None  # 13 tokens: all 4 blocks
    assert kv.prepare("b", list(range(50, 55)), num_ahead=1) is None
    assert kv.num_requests == 1
    kv.check_invariants()
    kv.release("a")
    assert kv.prepare("b", list(range(50, 55)), num_ahead=1) is not None
    kv.check_invariants()


def test_release_frees_every_block_and_forgets_the_request() -> None:
    kv = DraftKVCache(num_blocks=8, block_size=BLOCK, hash_extra=b"draft", enable_prefix_caching=False)
    kv.prepare("a", list(range(9)), num_ahead=3)
    kv.computed("a", [1, 2])
    kv.release("a")
    kv.release("a")  # twice is harmless (a preempted request that then finishes)
    assert kv.num_requests == 0 and kv.kv.pool.num_free == 8
    kv.check_invariants()
