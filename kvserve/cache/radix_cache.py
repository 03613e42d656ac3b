"""A radix tree over full KV blocks: the prefix cache.

Each node holds a run of consecutive full blocks (their chained hashes, token ids and block ids); a child
is keyed by the hash of its first block. Because hashes are chained, a key names the whole prefix up to
and including its block, and a hit is confirmed on the token ids, never on the hash alone.

    root ── [sys prompt: b0 b1 b2] ──┬── [turn A: b3 b4]
                                     └── [turn B: b7] ── [b8 b9]

``lock_ref`` counts the requests using a node or any node below it (locking walks to the root), so a
node's count is always >= the sum of its children's. Only leaves with ``lock_ref == 0`` are evicted,
least recently used first, block by block from their tail; a parent that becomes an unlocked leaf is
next in line. The tree owns the blocks it holds (``BlockPool.cached``); running requests add references.

A node may also keep *tails*: partly filled blocks that finished requests left after the node's last full
block (``TailBlock``). The next turn of a conversation resends the previous reply, whose last block was
never full; a request whose tokens continue the same way takes the block over and computes on from where
the tokens part, instead of recomputing up to a block of tokens. Each tail is used by one request at most
(it writes its own tokens into the rest of the block), and tails are evicted like leaves, by LRU.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvserve.block_hash import BlockHash, block_identity
from kvserve.cache.block_pool import BlockPool
from kvserve.cache.kv_events import KVEventLog


class RadixNode:
    __slots__ = ("node_id", "parent", "children", "block_hashes", "token_ids", "block_ids", "lock_ref",
                 "last_access", "depth", "tails")

    def __init__(self, node_id: int, parent: RadixNode | None, depth: int, now: float) -> None:
        self.node_id = node_id
        self.parent = parent
        self.children: dict[BlockHash, RadixNode] = {}
        self.block_hashes: list[BlockHash] = []
        self.token_ids: list[int] = []  # block_size tokens per block, concatenated
        self.block_ids: list[int] = []
        self.lock_ref = 0
        self.last_access = now
        self.depth = depth  # blocks from the root to the END of this node
        self.tails: list[TailBlock] = []  # partly filled blocks continuing from the end of this node

    @property
    def start_depth(self) -> int:
        return self.depth - len(self.block_ids)

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return f"RadixNode(id={self.node_id}, blocks={self.block_ids}, lock_ref={self.lock_ref}, depth={self.depth})"


@dataclass(slots=True, eq=False)
class TailBlock:
    """A partly filled block holding the KV of ``token_ids`` (fewer than a block), which follow the last
    full block of ``node``. ``salt`` is the request's hash salt: tails at the root have no hash chain."""

    node: RadixNode
    token_ids: tuple[int, ...]
    block_id: int
    salt: bytes
    last_access: float
    tail_id: int


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The longest cached run of blocks for a token sequence, ending at ``node`` (a block boundary)."""

    node: RadixNode
    block_ids: list[int]


EvictHook = Callable[[int, BlockHash, bytes], None]  # (block id, chained hash, block_identity)

# Tails kept per node: a node is where one conversation's turn ended; a few differing continuations
# (retries, n > 1) are worth keeping, more is mostly memory held for nothing.
MAX_TAILS_PER_NODE = 4


class RadixCache:
    def __init__(
        self,
        block_size: int,
        pool: BlockPool,
        clock: Callable[[], float] = time.monotonic,
        on_evict: EvictHook | None = None,
        events: KVEventLog | None = None,
    ) -> None:
        self.block_size = block_size
        self.pool = pool
        self.clock = clock
        # Called with (block_id, block_hash, identity) for each evicted block, before the block goes back to
        # the free list: its KV is still intact until whoever allocates it next writes into it.
        self.on_evict = on_evict
        self.events = events  # full blocks entering and leaving the tree, for gateways that follow them
        self._ids = itertools.count()
        self.root = RadixNode(next(self._ids), None, 0, clock())
        self.num_cached_blocks = 0  # full blocks in nodes (tails not included)
        self.num_evicted_blocks = 0
        self._tails: dict[int, TailBlock] = {}  # every tail attached to a node, by tail_id

    # --- lookup -------------------------------------------------------------------------------------------
    def match_prefix(self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int], max_blocks: int) -> PrefixMatch:
        """Longest run (at most ``max_blocks``) of cached blocks matching ``token_ids``; splits a node when
        the match ends inside it, so the returned node ends exactly at the match. Touches the path (LRU)."""
        now = self.clock()
        node = self.root
        block_ids: list[int] = []
        for child, n in self._walk(block_hashes, token_ids, max_blocks):
            if n < len(child.block_ids):
                child = self._split(child, n)
            child.last_access = now
            block_ids.extend(child.block_ids)
            node = child
        return PrefixMatch(node, block_ids)

    def match_length(self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int], max_blocks: int) -> int:
        """Blocks ``match_prefix`` would find, without splitting nodes or touching the LRU (for ordering)."""
        return sum(n for _, n in self._walk(block_hashes, token_ids, max_blocks))

    def _walk(
        self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int], max_blocks: int
    ) -> Iterator[tuple[RadixNode, int]]:
        """(node, blocks of it that match) along the path of the sequence; only the last may match partly."""
        node, matched = self.root, 0
        limit = min(max_blocks, len(block_hashes))
        while matched < limit:
            child = node.children.get(block_hashes[matched])
            if child is None:
                return
            n = self._count_matching_blocks(child, block_hashes, token_ids, matched, limit)
            if n == 0:
                return
            partial = n < len(child.block_ids)  # decided before the caller may split the node
            yield child, n
            if partial:
                return
            matched += n
            node = child

    def _count_matching_blocks(
        self, child: RadixNode, block_hashes: Sequence[BlockHash], token_ids: Sequence[int], start: int, limit: int
    ) -> int:
        bs = self.block_size
        n = 0
        while n < len(child.block_ids) and start + n < limit:
            if child.block_hashes[n] != block_hashes[start + n]:
                break
            lo = (start + n) * bs
            if child.token_ids[n * bs : (n + 1) * bs] != list(token_ids[lo : lo + bs]):
                break  # a hash collision: never trust the hash alone
            n += 1
        return n

    def _split(self, node: RadixNode, n: int) -> RadixNode:
        """Cut ``node`` after its first ``n`` blocks; returns the new upper node (same lock_ref)."""
        bs = self.block_size
        parent = node.parent
        assert parent is not None and 0 < n < len(node.block_ids)
        upper = RadixNode(next(self._ids), parent, node.start_depth + n, node.last_access)
        upper.block_hashes, node.block_hashes = node.block_hashes[:n], node.block_hashes[n:]
        upper.token_ids, node.token_ids = node.token_ids[: n * bs], node.token_ids[n * bs :]
        upper.block_ids, node.block_ids = node.block_ids[:n], node.block_ids[n:]
        upper.lock_ref = node.lock_ref
        parent.children[upper.block_hashes[0]] = upper
        upper.children[node.block_hashes[0]] = node
        node.parent = upper
        return upper

    # --- locking ------------------------------------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        while node is not self.root:
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: RadixNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, f"unlock of unlocked {node}"
            node.lock_ref -= 1
            node = node.parent  # type: ignore[assignment]

    # --- insertion ----------------------------------------------------------------------------------------
    def insert(
        self,
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        start: RadixNode | None = None,
    ) -> RadixNode:
        """Insert the first ``len(block_ids)`` blocks of a sequence; returns the node ending at the last one.

        ``start`` (a node on the sequence's path, e.g. the one its request has locked) skips the walk
        over blocks already known to be in the tree. Where the tree already holds a block for the same
        key it keeps its own copy; the caller's duplicate stays private to the caller. The caller's
        blocks must be referenced (held by a running request): the tree marks the new ones cached.
        """
        bs = self.block_size
        now = self.clock()
        node = start or self.root
        depth = node.depth
        total = len(block_ids)
        while depth < total:
            child = node.children.get(block_hashes[depth])
            if child is not None:
                n = self._count_matching_blocks(child, block_hashes, token_ids, depth, total)
                if n == 0:  # hash collision with different tokens: leave the tree as it is
                    return node
                if n < len(child.block_ids):
                    child = self._split(child, n)
                child.last_access = now
                node, depth = child, child.depth
                continue
            new_hashes = list(block_hashes[depth:total])
            new_tokens = list(token_ids[depth * bs : total * bs])
            new_blocks = list(block_ids[depth:total])
            for block_id in new_blocks:
                self.pool.mark_cached(block_id)
            self.num_cached_blocks += len(new_blocks)
            if self.events is not None:
                self.events.stored(new_hashes)
            if node is start and node is not self.root and node.is_leaf and node.lock_ref == 1 and not node.tails:
                # Extend a leaf that only its inserter holds, instead of growing a chain of one-block nodes
                # (not one with tails: they follow the node's current end).
                node.block_hashes.extend(new_hashes)
                node.token_ids.extend(new_tokens)
                node.block_ids.extend(new_blocks)
                node.depth = total
                node.last_access = now
                return node
            child = RadixNode(next(self._ids), node, total, now)
            child.block_hashes, child.token_ids, child.block_ids = new_hashes, new_tokens, new_blocks
            child.lock_ref = 0
            node.children[new_hashes[0]] = child
            return child
        return node

    # --- tails: partly filled blocks ------------------------------------------------------------------------
    @property
    def num_tail_blocks(self) -> int:
        return len(self._tails)

    def tail_blocks(self) -> list[TailBlock]:
        return list(self._tails.values())

    def add_tail(self, node: RadixNode, token_ids: Sequence[int], block_id: int, salt: bytes) -> bool:
        """Keep the partly filled block a request leaves after ``node`` (its KV of ``token_ids``, which
        continue from the node's end). The block must be held by that request alone; the tree takes it
        over (the caller then drops its reference). False, keeping nothing, when a tail already holds the
        same tokens or more."""
        assert 0 < len(token_ids) < self.block_size, "a tail is a partly filled block"
        tokens = tuple(token_ids)
        now = self.clock()
        for tail in list(node.tails):
            if tail.salt != salt:
                continue
            if tail.token_ids[: len(tokens)] == tokens:
                tail.last_access = now
                return False
            if tokens[: len(tail.token_ids)] == tail.token_ids:  # the new one holds this one and more
                self._drop_tail(tail)
        self.pool.mark_cached(block_id)
        tail = TailBlock(node, tokens, block_id, salt, now, next(self._ids))
        node.tails.append(tail)
        self._tails[tail.tail_id] = tail
        if len(node.tails) > MAX_TAILS_PER_NODE:
            self._drop_tail(min(node.tails[:-1], key=lambda t: t.last_access))
        return True

    def take_tail(self, node: RadixNode, token_ids: Sequence[int], salt: bytes) -> tuple[TailBlock, int] | None:
        """The tail after ``node`` whose tokens share the longest start with ``token_ids``, and that length,
        detached from the tree for one request; None if no tail shares a first token. The caller adds a
        reference to its block at once, then either adopts the block or gives the tail back with
        ``restore_tail``."""
        best, best_len = None, 0
        for tail in node.tails:
            if tail.salt != salt:
                continue
            n = 0
            for a, b in zip(tail.token_ids, token_ids, strict=False):
                if a != b:
                    break
                n += 1
            if n > best_len:
                best, best_len = tail, n
        if best is None:
            return None
        node.tails.remove(best)
        del self._tails[best.tail_id]
        return best, best_len

    def restore_tail(self, tail: TailBlock) -> None:
        """Attach again a tail that ``take_tail`` detached and nobody adopted."""
        tail.node.tails.append(tail)
        self._tails[tail.tail_id] = tail

    def _drop_tail(self, tail: TailBlock) -> None:
        """Give an unreferenced tail's block back to the free list."""
        tail.node.tails.remove(tail)
        del self._tails[tail.tail_id]
        self.pool.reclaim(tail.block_id)
        self.num_evicted_blocks += 1

    # --- eviction -----------------------------------------------------------------------------------------
    def evict(self, num_blocks: int) -> int:
        """Reclaim up to ``num_blocks`` blocks from unlocked leaves and tails, least recently used first;
        reports each full block to ``on_evict`` (tails are device-only). Returns how many were reclaimed."""
        heap: list[tuple[float, int, RadixNode | TailBlock]] = [
            (leaf.last_access, leaf.node_id, leaf) for leaf in self._evictable_leaves()]
        heap.extend((tail.last_access, tail.tail_id, tail) for tail in self._tails.values())
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_blocks and heap:
            _, _, entry = heapq.heappop(heap)
            if isinstance(entry, TailBlock):
                if entry.tail_id in self._tails:  # not already dropped with its node
                    self._drop_tail(entry)
                    evicted += 1
                continue
            leaf = entry
            while leaf.tails and evicted < num_blocks:  # they follow the blocks about to go
                self._drop_tail(leaf.tails[-1])
                evicted += 1
            take = min(num_blocks - evicted, len(leaf.block_ids))
            if take == 0:
                break
            cut = len(leaf.block_ids) - take
            if self.on_evict is not None:
                for i in range(cut, len(leaf.block_ids)):
                    self.on_evict(leaf.block_ids[i], leaf.block_hashes[i], self._identity(leaf, i))
            for block_id in leaf.block_ids[cut:]:
                self.pool.reclaim(block_id)
            if self.events is not None:
                self.events.removed(leaf.block_hashes[cut:])
            del leaf.block_ids[len(leaf.block_ids) - take :]
            del leaf.block_hashes[len(leaf.block_hashes) - take :]
            del leaf.token_ids[len(leaf.block_ids) * self.block_size :]
            leaf.depth -= take
            evicted += take
            self.num_cached_blocks -= take
            self.num_evicted_blocks += take
            if not leaf.block_ids:
                parent = leaf.parent
                assert parent is not None
                del parent.children[next(k for k, v in parent.children.items() if v is leaf)]
                if parent is not self.root and parent.is_leaf and parent.lock_ref == 0:
                    heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return evicted

    def _evictable_leaves(self) -> list[RadixNode]:
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(child for child in node.children.values() if child.lock_ref == 0 or child.children)
            elif node is not self.root and node.lock_ref == 0:
                leaves.append(node)
        return leaves

    def num_locked_nodes(self) -> int:
        """Nodes some request holds (0 once every request has finished: a lock left behind is a leak)."""
        count, stack = 0, list(self.root.children.values())
        while stack:
            node = stack.pop()
            count += node.lock_ref > 0
            stack.extend(node.children.values())
        return count

    def num_evictable_blocks(self) -> int:
        """Blocks in subtrees no request locks (all of them reclaimable by repeated leaf eviction), and tails."""
        total, stack = len(self._tails), list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.lock_ref == 0:
                total += len(node.block_ids)
            stack.extend(node.children.values())
        return total

    def cached_blocks(self) -> list[tuple[int, BlockHash, bytes]]:
        """(block id, chained hash, ``block_identity``) of every full block the tree holds."""
        out: list[tuple[int, BlockHash, bytes]] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.extend((block_id, block_hash, self._identity(node, i))
                       for i, (block_id, block_hash) in enumerate(zip(node.block_ids, node.block_hashes, strict=True)))
            stack.extend(node.children.values())
        return out

    def _identity(self, node: RadixNode, i: int) -> bytes:
        """``block_identity`` of the ``i``-th block of ``node``."""
        if i:
            parent: BlockHash | None = node.block_hashes[i - 1]
        else:
            parent = None if node.parent is None or node.parent is self.root else node.parent.block_hashes[-1]
        size = self.block_size
        return block_identity(parent, node.token_ids[i * size : (i + 1) * size])

    # --- integrity ----------------------------------------------------------------------------------------
    def check_invariants(self, other_cached: int = 0) -> None:
        """``other_cached``: blocks marked cached in the pool that the tree does not own (group pages)."""
        seen: set[int] = set()
        stack = [self.root]
        while stack:
            node = stack.pop()
            child_locks = sum(child.lock_ref for child in node.children.values())
            if node is not self.root:
                assert node.block_ids, f"{node} is empty"
                assert node.lock_ref >= child_locks, f"{node} lock_ref below its children's ({child_locks})"
                assert len(node.block_hashes) == len(node.block_ids)
                assert len(node.token_ids) == len(node.block_ids) * self.block_size
                assert node.parent is not None and node.depth == node.parent.depth + len(node.block_ids)
                for block_id in node.block_ids:
                    assert block_id not in seen, f"block {block_id} twice in the tree"
                    seen.add(block_id)
                    assert self.pool.cached[block_id], f"tree block {block_id} not marked cached"
                    if node.lock_ref == 0:
                        assert self.pool.ref_counts[block_id] == 0, f"block {block_id} used but unlocked"
            for key, child in node.children.items():
                assert child.parent is node and child.block_hashes[0] == key
                stack.append(child)
        assert len(seen) == self.num_cached_blocks, f"{len(seen)} blocks in tree, counter {self.num_cached_blocks}"
        for tail in self._tails.values():
            node = tail.node
            assert tail in node.tails and 0 < len(tail.token_ids) < self.block_size, f"bad tail {tail.tail_id}"
            assert node is self.root or (node.parent is not None and node.parent.children.get(node.block_hashes[0]) is node), (
                f"tail {tail.tail_id} hangs off a detached node")
            assert tail.block_id not in seen, f"tail block {tail.block_id} is also a full block of the tree"
            seen.add(tail.block_id)
            assert self.pool.cached[tail.block_id] and self.pool.ref_counts[tail.block_id] == 0, (
                f"tail block {tail.block_id} is not an unreferenced cached block")
        assert sum(self.pool.cached) == len(seen) + other_cached, "pool's cached flags disagree with the tree"
