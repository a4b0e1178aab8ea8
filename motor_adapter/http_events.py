"""``POST /events``: KV events pushed over HTTP (Motor 3.1's conductor API), into the same index.

Motor 3.1's conductor takes ``{instance_id, model_name?, tenant_id?, block_size, events:
[{event_id, dp_rank, type, ...}], shutdown}`` from workers that have no ZMQ stream (a
registration without any endpoint) or that push besides it.  Each event may be nested
(``{"data": {...}}``) or flat, typed by ``type`` / ``event_type`` / ``legacy_type`` (``stored``,
``removed``, ``cleared`` or the engine's ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``).

Here an event lands in the index of the registration it belongs to - ``(instance_id,
dp_rank)`` when that dp is registered, else the instance's one registration, whose engine
ranks the event's ``dp_rank`` then names (as the plugin's instance stream does) - under the
same name its ZMQ stream's blocks have, or, without a stream, the registration's
``index_name``.  So ``/query`` answers from both alike.

The index keys blocks by their token content: a stored event needs ``token_ids`` (and the
block size, the event's or the batch's).  Stores that carry only hashes (``blocks``,
``seq_hashes``: a pool's placement events) cannot be keyed and are counted as ignored, with
the reason in the answer.  A malformed body or event is refused whole (400, the event's
index named) before anything is applied.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Union

from motor_adapter.http_contract import I64_MIN, U64_MASK, RequestError
from motor_adapter.registration import DEFAULT_TENANT, Registration
from motor_adapter.state import AdapterState
from sglang_kvpub.wire.contract import AllBlocksCleared, BlockRemoved, BlockStored, Event

__all__ = ["EventsIngest", "parse_events"]

log = logging.getLogger(__name__)

_MAX_EVENTS = 65536  # per request (the body limit bounds it too)
_KINDS = (("removed", "removed"), ("stored", "stored"), ("cleared", "cleared"))


def _kind(event: Mapping[str, Any]) -> str:
    raw = event.get("event_type") or event.get("type") or event.get("legacy_type") or ""
    if not isinstance(raw, str):
        return "unknown"
    lower = raw.lower()
    for word, kind in _KINDS:  # "removed" first: Motor's conductor matches keywords in this order
        if word in lower:
            return kind
    return "unknown"


def _hashes(value: Any, where: str) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or any(
        isinstance(h, bool) or not isinstance(h, int) or not I64_MIN <= h <= U64_MASK for h in value
    ):
        raise RequestError(400, "bad_field", f"{where} must be a list of 64-bit integers")
    return [h & U64_MASK for h in value]


def _tokens(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or any(
        isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 1 << 32 for t in value
    ):
        raise RequestError(400, "bad_field", f"{where}.token_ids must be a list of token ids (0 <= id < 2**32)")
    return value


def _one(raw: Any, i: int, batch_block_size: int) -> tuple[int, Union[Event, str]]:
    """``(dp_rank, event)``, or ``(dp_rank, why it is ignored)``; raises 400 for a malformed event."""
    where = f"events[{i}]"
    if not isinstance(raw, Mapping):
        raise RequestError(400, "bad_field", f"{where} must be an object")
    nested = raw.get("data")
    data: Mapping[str, Any] = nested if isinstance(nested, Mapping) else raw
    dp = raw.get("dp_rank", 0)
    if isinstance(dp, bool) or not isinstance(dp, int) or not 0 <= dp < 1 << 16:
        raise RequestError(400, "bad_field", f"{where}.dp_rank must be an integer in [0, 65535]")
    medium = data.get("medium")
    if medium is not None and not isinstance(medium, str):
        raise RequestError(400, "bad_field", f"{where}.medium must be a string")
    kind = _kind(data)
    if kind == "cleared":
        return dp, AllBlocksCleared()
    blocks = data.get("blocks") or []
    if not isinstance(blocks, list) or any(not isinstance(b, Mapping) for b in blocks):
        raise RequestError(400, "bad_field", f"{where}.blocks must be a list of objects")
    engine = _hashes(data.get("block_hashes"), f"{where}.block_hashes")
    seq = _hashes(data.get("seq_hashes"), f"{where}.seq_hashes")
    listed = _hashes([b.get("block_hash") for b in blocks], f"{where}.blocks[].block_hash") if blocks else []
    if kind == "removed":
        return dp, BlockRemoved(seq + engine + listed, medium=medium)
    if kind != "stored":
        return dp, "unknown event type"
    if data.get("token_ids") in (None, []):
        return dp, "stored without token_ids (the index keys blocks by their tokens)"
    tokens = _tokens(data["token_ids"], where)
    size = data.get("block_size") or batch_block_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise RequestError(400, "bad_field", f"{where}.block_size must be a positive integer")
    parent = data.get("parent_block_hash", data.get("parent_hash"))
    if parent is not None:
        parent = _hashes([parent], f"{where}.parent_block_hash")[0]
    lora = data.get("lora_name")
    return dp, BlockStored(
        engine or seq or listed,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=size,
        medium=medium,
        lora_name=lora if isinstance(lora, str) else None,
    )


def parse_events(body: Mapping[str, Any]) -> tuple[str, Union[str, None], str, list[tuple[int, Union[Event, str]]]]:
    """``(instance_id, model_name or None, tenant, [(dp_rank, event or why ignored)])``; 400 on a bad body."""
    instance = body.get("instance_id")
    if not isinstance(instance, str) or not instance:
        raise RequestError(400, "bad_field", "instance_id (a non-empty string) is required")
    model = body.get("model_name")
    tenant = body.get("tenant_id") or DEFAULT_TENANT
    if (model is not None and not isinstance(model, str)) or not isinstance(tenant, str):
        raise RequestError(400, "bad_field", "model_name and tenant_id must be strings")
    size = body.get("block_size", 128)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise RequestError(400, "bad_field", "block_size must be a positive integer")
    events = body.get("events") or []
    if not isinstance(events, list) or len(events) > _MAX_EVENTS:
        raise RequestError(400, "bad_field", f"events must be a list of at most {_MAX_EVENTS} events")
    return instance, model, tenant, [_one(e, i, size) for i, e in enumerate(events)]


class EventsIngest:
    """Applies parsed events to the registered instance's index; counts what it did."""

    def __init__(self, state: AdapterState) -> None:
        self.state = state
        self.counted = state.metrics.http_events

    def _target(self, regs: Sequence[Registration], dp: int) -> Union[tuple[Registration, int], None]:
        for reg in regs:
            if reg.dp_rank == dp:
                return reg, reg.dp_rank if reg.stream is None else dp
        if len(regs) == 1:  # one endpoint for the instance: the event's dp_rank is an engine rank in it
            return regs[0], dp
        return None

    def apply(self, body: Mapping[str, Any]) -> dict[str, Any]:
        instance, model, tenant, events = parse_events(body)
        regs = [
            r
            for r in self.state.registrations(tenant=tenant)
            if r.instance_id == instance and (model is None or r.model == model)
        ]
        if not regs:
            self.counted.inc(len(events), result="unregistered")
            raise RequestError(
                404,
                "InstanceNotFound",
                f"instance {instance} is not registered (model {model!r}, tenant {tenant!r}): register it first - "
                "a registration without any endpoint takes its events from POST /events",
            )
        applied = 0
        ignored: dict[str, int] = {}
        for dp, event in events:
            target = self._target(regs, dp)
            if isinstance(event, str) or target is None:
                why = event if isinstance(event, str) else f"dp_rank {dp} is not registered for {instance}"
                ignored[why] = ignored.get(why, 0) + 1
                continue
            reg, rank = target
            name = reg.index_name
            affinity = self.state.affinity(reg.model, reg.tenant, reg.block_size)
            if name is None or affinity is None:
                why = f"dp {reg.dp_rank} is a {reg.mode} registration (no index to write)"
                ignored[why] = ignored.get(why, 0) + 1
                continue
            result = affinity.index.apply_event(name, rank, event)
            if result.ignored_block_size:
                why = f"block_size differs from the registration's {reg.block_size}"
                ignored[why] = ignored.get(why, 0) + 1
                continue
            applied += 1
        self.counted.inc(applied, result="applied")
        self.counted.inc(sum(ignored.values()), result="ignored")
        if body.get("shutdown") is True:  # as Motor's conductor: cleanup is the caller's /unregister
            log.info("POST /events: %s reports it is shutting down", instance)
        return {"status": "ok", "events_applied": applied, "ignored": ignored}
