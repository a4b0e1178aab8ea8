"""Why a prompt hits or misses: per instance and rank, blocks per tier and the first miss.

Reasons, checked in order of how often they bite in practice:
no registration / no subscription, block_size mismatch (the registration's vs the query's),
stream unhealthy (not connected, nothing received), tokenizer gave nothing, prompt
shorter than one block, and "tokens differ from the engine's": the first missing block is
held nowhere, while the same prompt shifted by a token (a BOS added or missing) matches
further - the special-token mismatch of the report's risk R8.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from motor_adapter.http_contract import as_dict

if TYPE_CHECKING:
    from motor_adapter.affinity import KvAffinity
    from motor_adapter.registration import Registration

__all__ = ["ExplainSource", "explain", "format_report"]


class ExplainSource(Protocol):
    """What :func:`explain` reads of the service's state (the service's ``AdapterState``
    satisfies it); a protocol, so this module never imports the service that calls it."""

    def registrations(self, model: str | None = None, tenant: str | None = None) -> list[Registration]: ...

    def affinity(self, model: str, tenant: str, block_size: int) -> KvAffinity | None: ...

    def stream_health(self) -> dict[tuple[str, str, int, str], list[Any]]: ...


# BOS ids of common families (DeepSeek 0, Llama-2/Mistral 1, Llama-3 128000, Qwen 151643):
# only used to test "one token missing at the front" when no tokenizer is known.
_COMMON_BOS = (0, 1, 2, 128000, 151643)


def _health_problem(healths: list[Any]) -> str | None:
    if not healths:
        return "stream unhealthy: no subscriber is running for it"
    for h in healths:
        rank = getattr(h, "dp_rank_override", None)
        where = f" (rank port {rank})" if rank is not None else ""
        if not getattr(h, "connected", False):
            return f"stream unhealthy{where}: not connected to {getattr(h, 'endpoint', '?')} or silent"
        if getattr(h, "batches", 0) == 0:
            return f"stream unhealthy{where}: connected but no batch received yet"
    return None


def _best(hits: dict[str, dict[int, Any]]) -> tuple[int, str | None, int | None]:
    best, where, rank = 0, None, None
    for stream, ranks in hits.items():
        for r, hit in ranks.items():
            total = hit.npu_blocks + hit.cpu_blocks + hit.disk_blocks
            if total > best:
                best, where, rank = total, stream, r
    return best, where, rank


def _shift_check(
    state: ExplainSource, model: str, tenant: str, block_size: int, tokens: list[int], best: int, bos: int | None
) -> dict[str, Any] | None:
    """Does the prompt match further with one special token added or removed at the front?"""
    aff = state.affinity(model, tenant, block_size)
    if aff is None:
        return None
    variants: list[tuple[str, list[int]]] = [
        ("first token dropped", tokens[1:]),
        ("first 2 tokens dropped", tokens[2:]),
    ]
    # Without the tokenizer's BOS, try the BOS ids of common model families.
    for candidate in dict.fromkeys([bos] if bos is not None else _COMMON_BOS):
        label = "BOS doubled" if tokens and tokens[0] == candidate else f"token {candidate} (a BOS?) prepended"
        variants.append((label, [candidate, *tokens]))
    found: dict[str, Any] | None = None
    for label, variant in variants:
        shifted, stream, rank = _best(aff.query(variant))
        if shifted > best and (found is None or shifted > found["matched_blocks"]):
            found = {"variant": label, "matched_blocks": shifted, "stream": stream, "engine_dp_rank": rank}
    return found


def explain(
    state: ExplainSource,
    model: str,
    tenant: str,
    block_size: int,
    tokens: list[int],
    *,
    tokenizer_error: str | None = None,
    bos_token_id: int | None = None,
) -> dict[str, Any]:
    """A JSON-able report; ``summary`` is one sentence, ``instances`` has the per-rank detail."""
    blocks = len(tokens) // block_size
    report: dict[str, Any] = {
        "model": model,
        "tenant_id": tenant,
        "block_size": block_size,
        "prompt_tokens": len(tokens),
        "prompt_blocks": blocks,
        "instances": [],
        "token_check": None,
    }
    regs = state.registrations(model, tenant)
    if not regs:
        known = sorted({f"{r.model}/{r.tenant}" for r in state.registrations()})
        report.update(
            verdict="miss",
            summary=f"no subscription: nothing is registered for model {model!r} tenant {tenant!r} "
            f"(registered: {', '.join(known) or 'none'}); Motor gets 404 NoIndexer and falls back to load_balance",
        )
        return report
    if not tokens:
        why = tokenizer_error or "the token list is empty"
        report.update(verdict="miss", summary=f"tokenizer gave nothing: {why}; Motor falls back to load_balance")
        return report
    aff = state.affinity(model, tenant, block_size)
    hits = aff.query(tokens) if aff is not None else {}
    health = state.stream_health()
    best, best_stream, best_rank = _best(hits)
    for reg in sorted(regs, key=lambda r: r.key):
        report["instances"].append(_explain_registration(state, reg, block_size, blocks, hits, health))
    if blocks == 0:
        report.update(
            verdict="miss",
            summary=f"prompt shorter than one block ({len(tokens)} < {block_size} tokens): Motor skips the conductor",
        )
        return report
    if best >= blocks:
        names = _names_of(regs, best_stream)
        report.update(verdict="hit", summary=f"full hit: {best} blocks on {names} engine rank {best_rank}")
        return report
    shift = _shift_check(state, model, tenant, block_size, tokens, best, bos_token_id)
    report["token_check"] = shift
    if shift is not None:
        names = _names_of(regs, shift["stream"])
        report.update(
            verdict="miss" if best == 0 else "partial",
            summary=f"tokens differ from the engine's: block {best} is held nowhere, but with the {shift['variant']} "
            f"{shift['matched_blocks']} blocks match on {names} rank {shift['engine_dp_rank']} - suspect special "
            "tokens/BOS (completions: encode(prompt) with add_special_tokens=True; chat: the template)",
        )
        return report
    reasons = sorted({i["reason"] for i in report["instances"] if i.get("reason")})
    if best == 0:
        summary = "miss on every instance: " + ("; ".join(reasons) or "no rank holds block 0")
        report.update(verdict="miss", summary=summary)
    else:
        names = _names_of(regs, best_stream)
        report.update(
            verdict="partial",
            summary=f"partial hit: {best} of {blocks} blocks on {names} engine rank {best_rank}; block {best} is "
            "not held (evicted, or this prompt's tail was never prefilled)",
        )
    return report


def _names_of(regs: list[Registration], stream: str | None) -> str:
    names = sorted({f"{r.instance_id} (dp {r.dp_rank})" for r in regs if r.index_name == stream})
    return ", ".join(names) or str(stream)


def _explain_registration(
    state: ExplainSource,
    reg: Registration,
    block_size: int,
    blocks: int,
    hits: dict[str, dict[int, Any]],
    health: dict[tuple[str, str, int, str], list[Any]],
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "instance_id": reg.instance_id,
        "dp_rank": reg.dp_rank,
        "stream": reg.stream,
        "mode": reg.mode,
        "block_size": reg.block_size,
        "ranks": [],
        "reason": None,
    }
    name = reg.index_name  # the stream, or for an HTTP-only registration the blocks POST /events brought
    if name is None:
        entry["reason"] = f"no subscription: the registration has no engine stream (mode {reg.mode})"
        return entry
    if reg.block_size != block_size:
        entry["reason"] = (
            f"block_size mismatch: registered {reg.block_size}, queried {block_size} - blocks are hashed per size, "
            "so nothing can match (set kv_conductor_config.block_size to the engine page size)"
        )
        return entry
    healths = health.get((reg.model, reg.tenant, reg.block_size, name), [])
    entry["health"] = [as_dict(h) for h in healths]
    problem = _health_problem(healths) if reg.stream is not None else None  # pushed blocks: no stream to be down
    aff = state.affinity(reg.model, reg.tenant, reg.block_size)
    known_ranks = set(aff.index.ranks(name)) if aff is not None and hasattr(aff, "index") else set()
    rank_hits = hits.get(name, {})
    for rank in sorted(known_ranks | set(rank_hits)):
        hit = rank_hits.get(rank)
        npu, cpu, disk = (hit.npu_blocks, hit.cpu_blocks, hit.disk_blocks) if hit is not None else (0, 0, 0)
        total = npu + cpu + disk
        missed = None if total >= blocks else total
        reason = None
        if missed is not None:
            reason = "block 0 is not held on this rank" if total == 0 else f"held up to block {total - 1} only"
        entry["ranks"].append(
            {
                "engine_dp_rank": rank,
                "npu_blocks": npu,
                "cpu_blocks": cpu,
                "disk_blocks": disk,
                "matched_blocks": total,
                "first_missed_block": missed,
                "reason": reason,
            }
        )
    if problem is not None:
        entry["reason"] = problem
    elif not entry["ranks"]:
        entry["reason"] = "the stream is healthy but has announced no blocks yet"
    return entry


def format_report(report: dict[str, Any]) -> str:
    """The human rendering ``motor-kv-adapter explain`` prints."""
    lines = [
        f"{report['verdict'].upper()}: {report['summary']}",
        f"model={report['model']} tenant={report['tenant_id']} block_size={report['block_size']} "
        f"prompt={report['prompt_tokens']} tokens ({report['prompt_blocks']} full blocks)",
    ]
    for inst in report.get("instances", []):
        head = f"  {inst['instance_id']} dp {inst['dp_rank']} stream={inst['stream']} mode={inst['mode']}"
        if inst.get("reason"):
            head += f": {inst['reason']}"
        lines.append(head)
        for rank in inst.get("ranks", []):
            line = (
                f"    rank {rank['engine_dp_rank']}: npu={rank['npu_blocks']} cpu={rank['cpu_blocks']} "
                f"disk={rank['disk_blocks']}"
            )
            if rank["first_missed_block"] is not None:
                line += f" first miss at block {rank['first_missed_block']} ({rank['reason']})"
            lines.append(line)
    return "\n".join(lines)
