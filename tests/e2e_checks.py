"""End-to-end assertions shared by every tier that runs a whole instance.

The NPU and GPU tiers (tests/npu/, a real ``sglang.launch_server``) and the CPU integration
tier (simulated engine / real SGLang classes on CPU) call the SAME functions, so what the
hardware tier asserts is exercised in CI too.  Inputs are plain data:

- ``stream``: the instance stream as a subscriber saw it, ``[(seq, wire.EventBatch), ...]``
  in arrival order;
- ``decision``: the adapter's decision as a mapping (or any object with attributes) with
  at least ``policy``, ``matched``, ``hbm`` and ``dp_rank``.

Each check raises ``AssertionError`` with a message that says what was expected and what the
stream held, and returns the figures it computed (for smoke reports).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sglang_kvpub import wire
from sglang_kvpub.core.hashing import local_block_hashes

Stream = Sequence[tuple[int, wire.EventBatch]]

POLICY_AFFINITY = "kv_cache_affinity"
POLICY_LOAD_BALANCE = "load_balance"


def _fail(message: str) -> None:
    raise AssertionError(message)


def _field(decision: Any, key: str) -> Any:
    if isinstance(decision, Mapping):
        return decision.get(key)
    return getattr(decision, key, None)


def _stores(stream: Stream) -> Iterable[tuple[int, int | None, wire.BlockStored]]:
    for seq, batch in stream:
        for event in batch.events:
            if isinstance(event, wire.BlockStored):
                yield seq, batch.dp_rank, event


# --------------------------------------------------------------------------- stream shape


def ranks_with_events(stream: Stream) -> dict[int | None, int]:
    """``{dp_rank: number of non-heartbeat batches}``."""
    counts: dict[int | None, int] = {}
    for _, batch in stream:
        if batch.events:
            counts[batch.dp_rank] = counts.get(batch.dp_rank, 0) + 1
    return counts


def check_ranks_in_one_stream(stream: Stream, expected_ranks: Iterable[int]) -> dict[int | None, int]:
    """One instance stream carries batches from every expected rank, each batch tagged with one."""
    counts = ranks_with_events(stream)
    if None in counts:
        _fail(f"{counts[None]} batches carry no dp_rank (the instance stream must tag every batch)")
    missing = sorted(set(expected_ranks) - set(counts))
    if missing:
        _fail(f"no batches from dp_rank {missing}; batches per rank: {counts}")
    return counts


def check_seq_increasing(stream: Stream) -> int:
    """Sequence numbers strictly increase (gaps are the subscriber's to repair); returns the count."""
    last: int | None = None
    for seq, _ in stream:
        if last is not None and seq <= last:
            _fail(f"seq went from {last} to {seq}")
        last = seq
    return len(stream)


def check_stored_blocks(
    stream: Stream, *, medium: str = wire.MEDIUM_GPU, block_size: int = 128, ranks: Iterable[int] | None = None
) -> int:
    """Every BlockStored in ``medium`` says ``block_size`` and has consistent token ids; at least
    one exists (per rank in ``ranks`` when given).  Returns the number of stored blocks."""
    blocks = 0
    seen_ranks: set[int | None] = set()
    for seq, rank, event in _stores(stream):
        if event.medium is None:
            _fail(f"seq {seq}: BlockStored without medium (rank {rank})")
        if event.medium != medium:
            continue
        if event.block_size != block_size:
            _fail(f"seq {seq}: BlockStored block_size {event.block_size}, expected {block_size} (rank {rank})")
        if len(event.token_ids) != len(event.block_hashes) * event.block_size:
            _fail(f"seq {seq}: {len(event.token_ids)} token ids for {len(event.block_hashes)} blocks")
        blocks += len(event.block_hashes)
        seen_ranks.add(rank)
    if blocks == 0:
        _fail(f"no BlockStored with medium={medium} in {len(stream)} batches")
    missing = sorted(set(ranks or ()) - seen_ranks)
    if missing:
        _fail(f"no BlockStored medium={medium} from dp_rank {missing}")
    return blocks


def resident_blocks(stream: Stream, medium: str = wire.MEDIUM_GPU) -> dict[int | None, set[int]]:
    """Per rank, the block hashes resident in ``medium`` after replaying the stream in order."""
    state: dict[int | None, set[int]] = {}
    for _, batch in stream:
        blocks = state.setdefault(batch.dp_rank, set())
        for event in batch.events:
            if isinstance(event, wire.AllBlocksCleared):
                blocks.clear()
            elif isinstance(event, wire.BlockStored) and event.medium == medium:
                blocks.update(wire.to_u64(h) for h in event.block_hashes)
            elif isinstance(event, wire.BlockRemoved) and event.medium in (medium, None):
                blocks.difference_update(wire.to_u64(h) for h in event.block_hashes)
    return state


def check_released_after(
    stream: Stream,
    after_seq: int,
    ranks: Iterable[int],
    *,
    medium: str = wire.MEDIUM_GPU,
    require_block_removed: bool = True,
) -> dict[int, int]:
    """After ``after_seq`` (e.g. /flush_cache) each rank released its blocks: BlockRemoved in
    ``medium`` (or, unless ``require_block_removed``, AllBlocksCleared), and nothing stays
    resident.  Returns ``{rank: blocks removed after after_seq}``."""
    removed: dict[int, int] = {}
    cleared: set[int] = set()
    for seq, batch in stream:
        if seq <= after_seq or batch.dp_rank is None:
            continue
        for event in batch.events:
            if isinstance(event, wire.BlockRemoved) and event.medium in (medium, None):
                removed[batch.dp_rank] = removed.get(batch.dp_rank, 0) + len(event.block_hashes)
            elif isinstance(event, wire.AllBlocksCleared):
                cleared.add(batch.dp_rank)
    for rank in ranks:
        if removed.get(rank, 0) == 0 and (require_block_removed or rank not in cleared):
            what = "BlockRemoved" if require_block_removed else "BlockRemoved or AllBlocksCleared"
            _fail(f"dp_rank {rank}: no {what} (medium={medium}) after seq {after_seq}")
    leftover = {r: len(b) for r, b in resident_blocks(stream, medium).items() if b and r in set(ranks)}
    if leftover:
        _fail(f"blocks still resident in {medium} after the release: {leftover}")
    return {rank: removed.get(rank, 0) for rank in ranks}


def check_prompt_on_rank(stream: Stream, token_ids: Sequence[int], rank: int, block_size: int = 128) -> int:
    """``rank`` announced the prompt's leading full blocks (compared by block content, the
    kv-conductor local hash).  Returns how many leading blocks that rank announced."""
    wanted = local_block_hashes(list(token_ids), block_size)
    if not wanted:
        _fail(f"prompt of {len(token_ids)} tokens has no full block of {block_size}")
    stored: set[int] = set()
    for _, event_rank, event in _stores(stream):
        if event_rank == rank and event.block_size == block_size:
            stored.update(local_block_hashes(list(event.token_ids), block_size))
    found = 0
    for key in wanted:  # prefix order: the first missing block ends the hit
        if key not in stored:
            break
        found += 1
    if found == 0:
        _fail(f"dp_rank {rank} announced none of the prompt's {len(wanted)} blocks")
    return found


# --------------------------------------------------------------------------- decisions


def check_affinity_decision(decision: Any, dp_rank: int | Iterable[int], *, min_hbm: int = 1) -> dict[str, Any]:
    """The repeat of a cached prompt: ``kv_cache_affinity``, ``hbm >= min_hbm``, on ``dp_rank``
    (or on one of several ranks, when round-robin put the prompt on more than one)."""
    allowed = {dp_rank} if isinstance(dp_rank, int) else set(dp_rank)
    figures = {key: _field(decision, key) for key in ("policy", "matched", "hbm", "dp_rank")}
    if figures["policy"] != POLICY_AFFINITY:
        _fail(f"expected policy={POLICY_AFFINITY}, got {figures}")
    hbm = figures["hbm"]
    if not isinstance(hbm, int) or hbm < min_hbm:
        _fail(f"expected hbm >= {min_hbm}, got {figures}")
    matched = figures["matched"]
    if not isinstance(matched, int) or matched < hbm:
        _fail(f"expected matched >= hbm, got {figures}")
    if figures["dp_rank"] not in allowed:
        _fail(f"expected dp_rank={'|'.join(map(str, sorted(allowed)))}, got {figures}")
    return figures


def check_cold_decision(decision: Any) -> dict[str, Any]:
    """A prompt nobody holds: ``load_balance`` with nothing matched."""
    figures = {key: _field(decision, key) for key in ("policy", "matched", "hbm", "dp_rank")}
    if figures["policy"] != POLICY_LOAD_BALANCE or figures["matched"] not in (None, 0):
        _fail(f"expected policy={POLICY_LOAD_BALANCE} matched=None, got {figures}")
    return figures
