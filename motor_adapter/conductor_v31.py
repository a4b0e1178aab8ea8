"""Motor 3.1's conductor shapes that differ from what Motor 3.0 reads (docs/motor.md, "Motor 3.1").

- ``/query_by_hash`` in blocks: Motor 3.1's Rust conductor answers it with every count in
  blocks (it scales by 1, not knowing the block size from hashes alone): ``{tenant:
  {instance: {"longest_matched": blocks, "DP": {"<dp>": {"matched_tokens": blocks,
  "npu_blocks", "cpu_blocks", "disk_blocks"}}}}}``.  The 3.0 line's answer (the same as
  ``/query``: tokens) stays the default; ``units: "blocks"`` in the body, or
  ``query_by_hash_units: "blocks"`` in the adapter's config, gives 3.1's.
- ``GET /workers``' ``indexer``: one entry per index (``model_name``, ``tenant_id``,
  ``worker_count``, ``total_blocks``, and ours: ``block_size``).

Cold instances stay listed (zeros), unlike Motor 3.1's conductor, which lists only instances
with a hit: Motor 3.1's policy drops an instance missing from the answer from the candidates,
so an idle cold instance could never win a request over a loaded warm one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

from motor_adapter.http_contract import RequestError
from motor_adapter.scoring import TierCounts, dp_entry, fold_engine_dps
from motor_adapter.state import AdapterState
from sglang_kvpub.core.hashing import chain_hashes

__all__ = ["QUERY_BY_HASH_UNITS", "blocks_answer", "by_hash_units", "indexer_summary"]

QUERY_BY_HASH_UNITS = ("tokens", "blocks")


def by_hash_units(asked: Union[str, None], configured: str) -> str:
    """The units of one ``/query_by_hash`` answer: the body's ``units``, else the configured."""
    units = asked or configured
    if units not in QUERY_BY_HASH_UNITS:
        raise RequestError(400, "bad_field", f"units must be one of {', '.join(QUERY_BY_HASH_UNITS)}, got {units!r}")
    return units


def _blocks_entry(hit: Union[TierCounts, None]) -> dict[str, int]:
    entry = dp_entry(hit, None, 1)  # block size 1: matched_tokens counts blocks, as Motor 3.1's conductor
    del entry["engine_dp_rank"]
    return entry


def blocks_answer(
    state: AdapterState, model: str, tenant: str, block_size: int, local_hashes: Sequence[int]
) -> dict[str, Any]:
    """Motor 3.1's ``/query_by_hash`` answer: every registered dp, counts in blocks.

    Each dp reports the engine rank with the longest weighted hit (as ``/query`` folds a
    fanned-in instance), never ranks added up."""
    keys = chain_hashes(local_hashes)
    hits, dps, _ = state.instance_hits(model, tenant, block_size, lambda aff: aff.query_keys(keys) if keys else {})
    cfg = state.scoring_config(block_size)
    out: dict[str, Any] = {}
    for instance, registered in dps.items():
        found = hits.get(instance, {})
        per_dp: dict[int, Union[TierCounts, None]]
        if len(registered) == 1:  # one registration: its engine ranks fold into its dp
            per_dp = {registered[0]: fold_engine_dps(found, cfg)}
        else:
            per_dp = {dp: found.get(dp) for dp in registered}
        table = {str(dp): _blocks_entry(hit) for dp, hit in per_dp.items()}
        longest = max((e["matched_tokens"] for e in table.values()), default=0)
        out[instance] = {"longest_matched": longest, "DP": table}
    return {tenant: out}


def indexer_summary(state: AdapterState) -> list[dict[str, Any]]:
    """``GET /workers``' ``indexer``: per index, its workers (instance stream, rank) and blocks."""
    keys = sorted({(r.model, r.tenant, r.block_size) for r in state.registrations()})
    summary = []
    for model, tenant, block_size in keys:
        affinity = state.affinity(model, tenant, block_size)
        stats = affinity.index.stats() if affinity is not None else None
        summary.append(
            {
                "model_name": model,
                "tenant_id": tenant,
                "block_size": block_size,
                "worker_count": stats.workers if stats is not None else 0,
                "total_blocks": stats.blocks if stats is not None else 0,
            }
        )
    return summary
