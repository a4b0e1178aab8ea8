"""Tool output: a batch as JSON-ready data (``sglang-kvpub tail --json``, the demo)."""

from __future__ import annotations

from typing import Any

from sglang_kvpub.wire.contract import (
    BlockRemoved,
    BlockStored,
    EventBatch,
)

__all__ = [
    "batch_to_json",
]


def batch_to_json(seq: int, batch: EventBatch) -> dict[str, Any]:
    """The ``sglang-kvpub tail --json`` object for one batch."""
    events: list[dict[str, Any]] = []
    for event in batch.events:
        if type(event) is BlockStored:
            events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": list(event.block_hashes),
                    "parent_block_hash": event.parent_block_hash,
                    "token_ids": list(event.token_ids),
                    "block_size": event.block_size,
                    "medium": event.medium,
                    "lora_name": event.lora_name,
                }
            )
        elif type(event) is BlockRemoved:
            events.append({"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": event.medium})
        else:
            events.append({"type": "AllBlocksCleared"})
    return {"seq": seq, "ts": batch.ts, "dp_rank": batch.dp_rank, "events": events}
