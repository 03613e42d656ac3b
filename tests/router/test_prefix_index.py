"""The approximate prefix index against a naive reference under random insert / match / forget."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.router.prefix_index import ApproximatePrefixIndex, page_keys

PAGE = 4
REPLICAS = ("r0", "r1", "r2")


class NaiveIndex:
    """Per replica, the set of page-aligned prompt prefixes it was sent, each with the time it was last sent;
    over capacity, the least recently sent prefix goes first, the longest of equals first."""

    def __init__(self, capacity_pages: dict[str, int]) -> None:
        self.capacity = capacity_pages
        self.prefixes: dict[str, dict[tuple[int, ...], tuple[int, int]]] = {r: {} for r in capacity_pages}
        self.clock = 0

    def insert(self, replica: str, tokens: list[int]) -> None:
        self.clock += 1
        held = self.prefixes[replica]
        num_pages = len(tokens) // PAGE
        for n in range(1, num_pages + 1):
            held[tuple(tokens[:n * PAGE])] = (self.clock, -n)  # shorter prefixes count as more recent
        while len(held) > self.capacity[replica]:
            del held[min(held, key=held.__getitem__)]

    def match(self, replica: str, tokens: list[int]) -> int:
        n = 0
        while n < len(tokens) // PAGE and tuple(tokens[:(n + 1) * PAGE]) in self.prefixes[replica]:
            n += 1
        return n

    def forget(self, replica: str) -> None:
        self.prefixes[replica] = {}


# Small alphabets and lengths so that prompts share prefixes often.
prompts = st.lists(st.integers(0, 2), min_size=0, max_size=5 * PAGE)
operations = st.lists(st.tuples(st.sampled_from(["insert", "match", "forget"]), st.sampled_from(REPLICAS), prompts),
                      max_size=60)


@settings(max_examples=300, deadline=None)
@given(capacities=st.lists(st.integers(1, 8), min_size=len(REPLICAS), max_size=len(REPLICAS)), ops=operations)
def test_the_index_matches_a_naive_reference(capacities: list[int], ops: list[tuple[str, str, list[int]]]) -> None:
    index = ApproximatePrefixIndex(PAGE)
    capacity = dict(zip(REPLICAS, capacities, strict=True))
    for replica in REPLICAS:
        index.add_replica(replica, capacity[replica] * PAGE)
    reference = NaiveIndex(capacity)
    for op, replica, tokens in ops:
        if op == "insert":
            index.insert(replica, page_keys(tokens, PAGE))
            reference.insert(replica, tokens)
        elif op == "forget":
            index.remove_replica(replica)
            index.add_replica(replica, capacity[replica] * PAGE)
            reference.forget(replica)
        matched = index.match(page_keys(tokens, PAGE), REPLICAS)
        assert matched == {r: reference.match(r, tokens) for r in REPLICAS}
        for r in REPLICAS:
            assert index.num_pages(r) == len(reference.prefixes[r]) <= capacity[r]


def test_page_keys_chain_the_whole_prefix() -> None:
    assert page_keys([1, 2, 3], PAGE) == []
    a = page_keys([1, 2, 3, 4, 5, 6, 7, 8], PAGE)
    b = page_keys([9, 2, 3, 4, 5, 6, 7, 8], PAGE)
    assert len(a) == 2 and a[1] != b[1]  # the same second page after a different first one is another key
    assert page_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], PAGE) == a
