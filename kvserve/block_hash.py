"""Chained block hashes: the key of a full block of KV is H(key of the block before || its token ids || the
request's extra keys). Stable across processes (blake2b, not Python's hash), so that lower storage tiers and
the gateway's index of replicas' caches key blocks as the engine does.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes


def block_identity(parent: BlockHash | None, token_ids: Sequence[int]) -> bytes:
    """What a full block is: its parent's chained hash and its token ids (what ``hash_block`` digests, less
    the request's extra keys). The tiers below device memory store it with the block's KV and compare it on
    every load, so a hit there never rests on the hash alone."""
    return (parent or b"\0" * 16) + array("I", token_ids).tobytes()


def salted_hash_extra(extra: bytes, salt: str | None, adapter_key: bytes = b"") -> bytes:
    """What a request mixes into its block hashes: the engine's ``extra`` (its model fingerprint), its LoRA
    adapter's key where it runs one, then its cache salt where it has one, so that its blocks match only those
    of requests with that adapter and salt. The adapter's key comes before the salt: no salt can spell it."""
    extra += adapter_key
    return extra if salt is None else extra + b"\0cache_salt:" + salt.encode("utf-8", "surrogatepass")


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    h = hashlib.blake2b(digest_size=16)
    h.update(block_identity(parent, token_ids))
    h.update(extra)
    return h.digest()
