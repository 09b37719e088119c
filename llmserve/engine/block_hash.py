"""Prefix block hashes: each full block of token ids hashed over its parent's hash, from a root
that names the model (and the LoRA adapter, if any). A pure module, with no engine state: the
block manager keys the prefix cache by these hashes, and the Ray request router
(ray_serve/router.py) keys prompt prefixes by the same ones."""

from __future__ import annotations

import hashlib
from array import array


def hash_block(parent: bytes, token_ids: tuple[int, ...] | list[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


def chain_block_hashes(root: bytes, token_ids: list[int], block_size: int, num_blocks: int) -> list[tuple[bytes, tuple[int, ...]]]:
    """(hash, tokens) of the first `num_blocks` full blocks of `token_ids`, each hash chained over
    its parent's from `root`."""
    chain, parent = [], root
    for i in range(min(num_blocks, len(token_ids) // block_size)):
        chunk = tuple(token_ids[i * block_size : (i + 1) * block_size])
        parent = hash_block(parent, chunk)
        chain.append((parent, chunk))
    return chain


def namespace_hash(namespace: str) -> bytes:
    return hashlib.blake2b(namespace.encode(), digest_size=16).digest()
