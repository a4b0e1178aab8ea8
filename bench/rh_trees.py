"""Real SGLang 0.5.23 tree caches on CPU with release hooks, and their truth (shared by rh tests and bench)."""

from __future__ import annotations

import functools
from array import array
from collections import defaultdict
from typing import Any

from bench import sglang_loader as sglang_real
from sglang_kvpub.core.residency import RankResidency
from sglang_kvpub.engine.release_hooks import (
    install_release_hooks,
    node_block_hashes,
    node_resident,
    tracker_of,
    tree_of,
)
from sglang_kvpub.wire import MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored


class CpuAllocator:
    """Just enough of a token-to-KV allocator for the tree caches (frees are counted)."""

    def __init__(self) -> None:
        import torch

        self.device = torch.device("cpu")
        self.freed = 0

    def free(self, indices: Any) -> None:
        self.freed += len(indices)

    def free_segment(self, indices: Any, start_pos: int = 0) -> None:
        self.freed += len(indices)

    def available_size(self) -> int:
        return 1 << 30


@functools.cache
def setup() -> Any:
    """SGLang's tree-cache modules (through sglang_real), release hooks installed (direct wrap); a namespace.

    Cached: every test module of a process shares one setup."""
    sglang_real.load_radix_cache()  # the full strategy, and the page-hash implementation for this machine

    def load(name: str) -> Any:
        return sglang_real.load_module(f"sglang.srt.mem_cache.{name}", sglang_real.RADIX_DEPS)

    ns = type("SG", (), {})()
    ns.radix = load("radix_cache")
    ns.base = load("base_prefix_cache")
    ns.unified = load("unified_radix_cache")
    ns.core = load("unified_cache.unified_tree_core")
    ns.params = load("cache_init_params")
    ns.ct = load("unified_cache.component_type").ComponentType
    install_release_hooks(None)
    return ns


def legacy_tree(ns: Any, page_size: int) -> Any:
    return ns.radix.RadixCache.create_simulated(
        mock_allocator=CpuAllocator(), page_size=page_size, enable_kv_cache_events=True
    )


def unified_tree(ns: Any, page_size: int) -> Any:
    params = ns.params.CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=CpuAllocator(),
        page_size=page_size,
        enable_kv_cache_events=True,
        tree_components=(ns.ct.FULL,),
        tree_core_backend="python",
    )
    return ns.unified.UnifiedRadixCache(params)


def key(ns: Any, tokens: list[int]) -> Any:
    return ns.radix.RadixKey(array("q", tokens))


def insert(ns: Any, tree: Any, tokens: list[int]) -> None:
    import torch

    tree.insert(ns.base.InsertParams(key=key(ns, tokens), value=torch.arange(len(tokens), dtype=torch.int64)))


def to_wire(event: Any) -> Any:
    """SGLang event struct -> the project's wire struct (what the publisher sends)."""
    name = type(event).__name__
    if name == "AllBlocksCleared":
        return AllBlocksCleared()
    medium = str(getattr(event.medium, "value", event.medium) or MEDIUM_GPU)
    if name == "BlockRemoved":
        return BlockRemoved(block_hashes=list(event.block_hashes), medium=medium)
    return BlockStored(
        block_hashes=list(event.block_hashes),
        parent_block_hash=event.parent_block_hash,
        token_ids=[int(t) for t in event.token_ids],
        block_size=event.block_size,
        lora_id=event.lora_id,
        medium=medium,
    )


def truth(tree: Any) -> dict[str, set[int]]:
    """Walk the real tree: block hashes resident per medium."""
    core = tree_of(tree)
    out: dict[str, set[int]] = defaultdict(set)
    stack = list(core.root_node.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        device, host = node_resident(node)
        if device or host:
            hashes = node_block_hashes(core.kv_events, node)
            if device:
                out[MEDIUM_GPU].update(hashes)
            if host:
                out[MEDIUM_CPU].update(hashes)
    return out


class Subscriber:
    """Rebuilds per-medium state from the published (taken) events."""

    def __init__(self) -> None:
        self.state = RankResidency()
        self.events = 0

    def drain(self, tree: Any) -> None:
        for event in tree.take_events():
            self.state.apply(to_wire(event))
            self.events += 1

    def media(self) -> dict[str, set[int]]:
        return {m: set(self.state.hashes(m)) for m in (MEDIUM_GPU, MEDIUM_CPU)}


def tracker(tree: Any) -> Any:
    return tracker_of(tree_of(tree).kv_events)
