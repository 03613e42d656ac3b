"""Sliding-window layers in KV groups of their own: their pages are freed once every query is past them, the
global layers keep all of theirs, and the prefix cache never serves a freed page.

The KV manager is driven directly (no model): requests are admitted, computed in chunks and decoded, and after
every operation the pool's counts, the tree's and the group tables' invariants are checked, with the pages
each request holds compared with what its position allows.
"""

from __future__ import annotations

import random

import pytest

from kvserve.arch import ArchConfig
from kvserve.cache.kv_manager import KVCacheManager
from kvserve.kv_layout import NULL_PAGE, KVLayout
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

BLOCK = 4
WINDOW = 8
# Three layers as the tiny Gemma 3 of the end-to-end tests: two sliding, one global -> three groups of one.
LAYOUT = KVLayout(num_layers=3, layers_per_page=1, groups=((2,), (0,), (1,)), windowed=(False, True, True),
                  window=WINDOW)


def _arch(num_layers: int, sliding: tuple[int, ...], window: int) -> ArchConfig:
    return ArchConfig("gemma3", vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=num_layers,
                      num_heads=4, num_kv_heads=1, head_dim=256, max_position_embeddings=32768,
                      sliding_window=window, sliding_layers=sliding)


def test_gemma3_270m_layers_make_six_groups_of_three() -> None:
    sliding = tuple(i for i in range(18) if (i + 1) % 6)
    layout = KVLayout.for_arch(_arch(18, sliding, 512))
    assert layout.groups[0] == (5, 11, 17) and layout.layers_per_page == 3 and layout.num_groups == 6
    assert layout.windowed == (False, True, True, True, True, True)
    assert sorted(layer for group in layout.groups for layer in group) == list(range(18))
    assert layout.layer_group[5] == 0 and layout.layer_group[0] == 1 and layout.layer_slot[11] == 1
    # The pages of 10 blocks of every layer, and the null page.
    assert layout.num_pages(10) == 61


def test_models_without_both_kinds_of_layer_keep_one_table() -> None:
    assert not KVLayout.for_arch(_arch(4, (), 0)).is_grouped
    assert not KVLayout.for_arch(_arch(4, (0, 1, 2, 3), 64)).is_grouped  # every layer sliding: nothing to split


def test_window_start() -> None:
    # A query at position p sees keys p - 7 .. p: block 0 (keys 0-3) is needed until p = 10.
    assert [LAYOUT.first_block_in_window(p, BLOCK) for p in (0, 7, 10, 11, 12, 15)] == [0, 0, 0, 1, 1, 2]


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=64), max_total_tokens=len(tokens) + 64)


def _allocate(kv: KVCacheManager, request: Request, num_tokens: int, hit=None) -> bool:
    """``kv.allocate``; once allocated, the window tables hold exactly the blocks the step's queries read."""
    if not kv.allocate(request, num_tokens, *([hit] if hit is not None else [])):
        return False
    first = LAYOUT.first_block_in_window(request.num_computed_tokens, BLOCK)
    for g, table in enumerate(request.group_block_ids, start=1):
        if LAYOUT.windowed[g]:
            assert all(page == NULL_PAGE for page in table[:first]), "a page before the window is held"
    return True


def _compute(kv: KVCacheManager, request: Request, num_tokens: int, hit=None) -> None:
    """Schedule and 'compute' ``num_tokens`` more tokens, as the scheduler and runner would."""
    assert _allocate(kv, request, num_tokens, hit)
    kv.cache_blocks(request, request.num_computed_tokens + num_tokens)
    request.num_computed_tokens += num_tokens


def _decode(kv: KVCacheManager, request: Request, steps: int) -> None:
    for _ in range(steps):
        if request.num_computed_tokens == request.num_tokens:
            request.append_token(7)
        _compute(kv, request, request.num_tokens - request.num_computed_tokens)


def _live_window_pages(request: Request) -> int:
    return sum(page != NULL_PAGE for table in request.group_block_ids[1:] for page in table)


def _check(kv: KVCacheManager, running: list[Request]) -> None:
    kv.check_invariants()
    held = set()
    for request in running:
        assert all(len(table) == len(request.block_ids) for table in request.group_block_ids)
        first = LAYOUT.first_block_in_window(request.num_computed_tokens, BLOCK)
        for g, table in enumerate(request.group_block_ids, start=1):
            if LAYOUT.windowed[g]:
                assert all(page != NULL_PAGE for page in table[first:]), "a page in the window is missing"
            held.update(page for page in table if page != NULL_PAGE)
        held.update(request.block_ids)
    for page in held:
        assert kv.pool.ref_counts[page] > 0


def test_decoding_past_the_window_frees_the_window_pages_without_prefix_cache() -> None:
    kv = KVCacheManager(1 + 3 * 40, BLOCK, enable_prefix_caching=False, layout=LAYOUT)
    request = _request("a", list(range(10, 30)))  # 20 tokens: 5 blocks
    _compute(kv, request, 20)
    _decode(kv, request, 40)  # 60 tokens: 15 blocks
    _check(kv, [request])
    # The global group keeps every block; each window group keeps the blocks of the last window only.
    first = LAYOUT.first_block_in_window(request.num_computed_tokens, BLOCK)
    assert len(request.block_ids) == 15 and first == 13
    assert kv.pool.num_used == 15 + 2 * (15 - first)  # group 0, then the two window groups
    assert kv.pool.num_free == kv.pool.num_blocks - 1 - kv.pool.num_used  # less the null page
    kv.free(request)
    assert kv.pool.num_free == kv.pool.num_blocks - 1 and kv.pool.num_used == 0
    kv.check_invariants()


def test_window_pages_left_behind_are_reclaimed_before_running_short() -> None:
    # Room for one request's global blocks and its window only: decoding on must reuse the freed pages.
    kv = KVCacheManager(1 + 30 + 2 * 5, BLOCK, enable_prefix_caching=True, layout=LAYOUT)
    request = _request("a", list(range(100, 112)))
    _compute(kv, request, 12)
    _decode(kv, request, 100)  # 112 tokens: 28 blocks of the global group
    _check(kv, [request])
    assert kv.pool.num_used <= 28 + 2 * 4


def test_a_hit_needs_the_window_pages_before_its_end() -> None:
    kv = KVCacheManager(1 + 3 * 40, BLOCK, enable_prefix_caching=True, layout=LAYOUT)
    prompt = list(range(200, 240))  # 40 tokens: 10 blocks
    first = _request("a", prompt)
    _compute(kv, first, 40)
    kv.free(first)
    _check(kv, [])

    # Everything is still cached: the same prompt hits 9 blocks (the last token is always computed).
    second = _request("b", prompt)
    hit = kv.lookup(second)
    assert hit.num_tokens == 36
    # Its window tables start with the null page before the window of position 36, then the cached pages.
    start = LAYOUT.first_block_in_window(36, BLOCK)
    assert all(pages[:start] == [NULL_PAGE] * start for pages in hit.group_block_ids[1:])
    assert all(NULL_PAGE not in pages[start:] for pages in hit.group_block_ids[1:])
    kv.release_hit(hit)

    # Drop the window pages no request holds: the blocks stay cached, but no hit can be served from them.
    kv.groups.evict_idle(kv.pool.num_blocks)
    _check(kv, [])
    third = _request("c", prompt)
    assert kv.lookup(third).num_tokens == 0
    # A prompt ending within the first window needs no dropped page either... but those were dropped too.
    assert kv.lookup(_request("d", prompt[:9])).num_tokens == 0


def test_a_hit_ends_where_the_window_pages_still_are() -> None:
    kv = KVCacheManager(1 + 3 * 40, BLOCK, enable_prefix_caching=True, layout=LAYOUT)
    prompt = list(range(300, 340))  # 10 blocks
    first = _request("a", prompt)
    _compute(kv, first, 40)
    _decode(kv, first, 12)  # past the prompt: the prompt's window pages are left behind, cached
    second = _request("b", prompt + [1, 2, 3])
    hit = kv.lookup(second)
    assert hit.num_tokens == 40  # all 10 prompt blocks, with the prompt's last window cached
    assert _allocate(kv, second, second.num_tokens - hit.num_tokens, hit)
    _check(kv, [first, second])
    # Pages shared by the two requests are not freed while the second one still reads them.
    shared = second.group_block_ids[1][-2]
    assert shared != NULL_PAGE and kv.pool.ref_counts[shared] == 1
    kv.free(first)
    kv.free(second)
    _check(kv, [])


@pytest.mark.parametrize("seed", range(6))
def test_random_admissions_decodes_and_evictions_keep_every_invariant(seed: int) -> None:
    rng = random.Random(seed)
    kv = KVCacheManager(1 + 3 * 24, BLOCK, enable_prefix_caching=seed % 3 != 0, layout=LAYOUT)
    prefixes = [[rng.randrange(3) for _ in range(rng.randrange(4, 30))] for _ in range(3)]
    running: list[Request] = []
    for step in range(120):
        action = rng.random()
        if action < 0.3 and len(running) < 4:
            tokens = rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randrange(1, 9))]
            request = _request(f"r{step}", tokens)
            hit = kv.lookup(request)
            if _allocate(kv, request, request.num_tokens - hit.num_tokens, hit):
                kv.cache_blocks(request, request.num_tokens)
                request.num_computed_tokens = request.num_tokens
                running.append(request)
            else:
                kv.release_hit(hit)
        elif action < 0.85 and running:
            request = rng.choice(running)
            request.append_token(rng.randrange(3))
            if _allocate(kv, request, 1):
                kv.cache_blocks(request, request.num_tokens)
                request.num_computed_tokens += 1
            else:  # preempted
                running.remove(request)
                kv.free(request)
        elif running:
            request = running.pop(rng.randrange(len(running)))
            kv.free(request)
        _check(kv, running)
    for request in running:
        kv.free(request)
    _check(kv, [])
    assert kv.pool.num_used == 0
