"""Motor's kv_cache_affinity decision, computed from per-rank prefix hits (pure, no I/O).

The pipeline for one request:

1. ``hits_by_instance``: for every instance, the per-engine-rank hit split over tiers
   (NPU, then CPU, then disk, exclusive) as the prefix index reports it;
2. :func:`fold_engine_dps`: the ONE rank of an instance with the longest weighted hit -
   never the union of ranks, since a prefix split over two ranks is not a hit anywhere;
3. Motor's cost (``motor-conductor.md`` section 3.5), exactly::

       matched      = min(round((npu*w_npu + cpu*w_cpu + disk*w_disk) * block_size), isl)
       prefill_cost = max(0, isl - overlap_credit * matched)
       unified:     score = prefill_load_scale*prefill_cost + load_weight*load, lowest wins
       load_gated:  keep the load_gate_topn (0 -> 2) least loaded, then longest match

4. a :class:`Decision` that carries the engine rank to pin (``routed_dp_rank`` /
   ``X-Data-Parallel-Rank``) and renders Motor's ``scheduled role=...`` log line.

:func:`conductor_response` renders the same hits as kv-conductor's ``/query`` JSON, with a
fanned-in instance's engine ranks folded into the dp Motor registered.

Why one module over 450 lines: it is Motor's ``kv_cache_affinity`` in one place - the
configuration Motor reads, the cost, the fold over ranks and the two answer shapes - each
part checked against the released Motor in tests/adapter/test_scoring.py and tests/motor_compat/test_motor_real.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, Union

from sglang_kvpub.core.cost_settings import COST_KEYS, cost_problems, number_problems
from sglang_kvpub.core.errors import ConfigError
from sglang_kvpub.core.tiers import TierHit

__all__ = [
    "MODES",
    "MOTOR_BOOK_MARGIN",
    "POLICY_AFFINITY",
    "POLICY_LOAD_BALANCE",
    "Candidate",
    "CandidateScore",
    "ConfigError",
    "INVALID",
    "Decision",
    "FoldedHit",
    "KvAffinityConfig",
    "TierCounts",
    "best_rank",
    "conductor_response",
    "dp_entry",
    "fold_engine_dps",
    "matched_tokens",
    "prefill_cost",
    "QUERY_SHAPES",
    "RankScored",
    "motor_values",
    "pick_instance",
    "instance_entry",
    "select",
    "weighted_blocks",
]

Mode = Literal["unified", "load_gated"]
MODES: tuple[str, ...] = ("unified", "load_gated")
POLICY_AFFINITY = "kv_cache_affinity"
POLICY_LOAD_BALANCE = "load_balance"
_DEFAULT_TOPN = 2  # Motor turns load_gate_topn=0 into 2 at runtime


TierCounts = TierHit  # the name scoring has always used for a hit triple


# --------------------------------------------------------------------------- configuration


INVALID = "invalid kv_affinity configuration"  # heads every ConfigError message of the adapter


_FLOAT_KEYS = ("load_weight", "overlap_credit", "prefill_load_scale", "w_npu", "w_cpu", "w_disk", "hit_rate_threshold")
_INT_KEYS = ("load_gate_topn", "block_size")
_GUARD_KEYS = ("hotspot_spread", "hotspot_relative")  # null: that half of the guard is off
# Keys Motor's older releases kept flat in scheduler_config as kv_affinity_<key>.
_FLAT_PREFIX = "kv_affinity_"


@dataclasses.dataclass(frozen=True)
class KvAffinityConfig:
    """Motor's ``scheduler_config.kv_affinity`` settings, with Motor's defaults.

    ``block_size`` must equal the engine's page size.  Motor sends its block size in every
    registration and query, from ``engine_config.block-size`` (default 128); this one is only the
    adapter's default for requests that name none.
    """

    mode: str = "unified"
    load_weight: float = 1.0
    overlap_credit: float = 1.0
    prefill_load_scale: float = 1.0
    load_gate_topn: int = 0
    w_npu: float = 1.0
    w_cpu: float = 1.0
    w_disk: float = 0.0
    hit_rate_threshold: float = 0.0
    block_size: int = 128
    # The rank cost's hot-spot guard (sglang_kvpub.core.rank_cost), not Motor's: no Motor reads
    # them; set them equal to the engine plugin's keys of the same names (docs/dispatch.md).
    hotspot_spread: Union[float, None] = None
    hotspot_relative: Union[float, None] = None

    def __post_init__(self) -> None:
        problems = _validate(dataclasses.asdict(self), prefix="kv_affinity.")
        if problems:
            raise ConfigError(problems, INVALID)
        # Normalise what JSON may spell loosely: "Unified", 128.0.
        object.__setattr__(self, "mode", self.mode.strip().lower())
        for key in _INT_KEYS:
            object.__setattr__(self, key, int(getattr(self, key)))
        for key in _FLOAT_KEYS:
            object.__setattr__(self, key, float(getattr(self, key)))
        for key in _GUARD_KEYS:
            value = getattr(self, key)
            object.__setattr__(self, key, None if value is None else float(value))

    @property
    def gate_topn(self) -> int:
        """How many least-loaded candidates ``load_gated`` keeps (0 means 2, as in Motor)."""
        return self.load_gate_topn or _DEFAULT_TOPN

    def weighted(self, hit: TierCounts) -> float:
        return weighted_blocks(hit, self)

    @classmethod
    def from_motor(cls, config: Mapping[str, Any]) -> KvAffinityConfig:
        """Reads Motor's configuration at any of its levels.

        Accepts the whole user_config (``motor_coordinator_config.scheduler_config``), a
        ``scheduler_config`` (nested ``kv_affinity`` and/or the older flat ``kv_affinity_*``
        keys - nested wins), or the ``kv_affinity`` dict itself. ``block_size`` is taken from a
        ``kv_conductor_config.block_size`` (scheduler_config's or top-level) unless the
        ``kv_affinity`` dict sets it: Motor itself never reads that key (it sends
        ``engine_config.block-size``), but a config written for the adapter may carry it.
        Raises :class:`ConfigError` listing every problem.
        """
        if not isinstance(config, Mapping):
            raise ConfigError([f"expected a JSON object, got {type(config).__name__}"], INVALID)
        values, where, conductor = _collect(config)
        if conductor is not None and "block_size" not in values:
            values["block_size"] = conductor
        problems = _validate(values, prefix=where)
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
        problems += [
            f"{where}{key} is not a kv_affinity setting: remove it (known: {', '.join(_known_keys())})"
            for key in unknown
        ]
        if problems:
            raise ConfigError(problems, INVALID)
        return cls(**values)


def _known_keys() -> list[str]:
    return [f.name for f in dataclasses.fields(KvAffinityConfig)]


def _collect(config: Mapping[str, Any]) -> tuple[dict[str, Any], str, Any]:
    """``(kv_affinity values, key prefix for messages, kv_conductor_config.block_size)``."""
    top_conductor = config.get("kv_conductor_config")
    scheduler: Mapping[str, Any] | None = None
    where = "scheduler_config."
    coordinator = config.get("motor_coordinator_config")
    if isinstance(coordinator, Mapping):
        scheduler = coordinator.get("scheduler_config") or {}
        where = "motor_coordinator_config.scheduler_config."
    elif isinstance(config.get("scheduler_config"), Mapping):
        scheduler = config["scheduler_config"]
    elif _looks_like_scheduler_config(config):
        scheduler = config
        where = ""
    if scheduler is None:  # the kv_affinity dict itself
        return dict(config), "kv_affinity.", None
    if not isinstance(scheduler, Mapping):
        raise ConfigError([f"{where.rstrip('.')} must be a JSON object"], INVALID)
    values = {str(k)[len(_FLAT_PREFIX) :]: v for k, v in scheduler.items() if str(k).startswith(_FLAT_PREFIX)}
    nested = scheduler.get("kv_affinity")
    if nested is not None and not isinstance(nested, Mapping):
        raise ConfigError([f"{where}kv_affinity must be a JSON object, got {type(nested).__name__}"], INVALID)
    values.update(nested or {})
    conductor = scheduler.get("kv_conductor_config") or top_conductor
    block_size = conductor.get("block_size") if isinstance(conductor, Mapping) else None
    return values, f"{where}kv_affinity.", block_size


def _looks_like_scheduler_config(config: Mapping[str, Any]) -> bool:
    markers = ("kv_affinity", "scheduler_type", "kv_conductor_config")
    return any(k in config for k in markers) or any(str(k).startswith(_FLAT_PREFIX) for k in config)


def _validate(values: Mapping[str, Any], prefix: str) -> list[str]:
    problems: list[str] = []
    mode = values.get("mode", "unified")
    if not isinstance(mode, str) or mode.strip().lower() not in MODES:
        problems.append(f'{prefix}mode is {mode!r}: set it to "unified" or "load_gated"')
    problems += cost_problems(values, prefix)  # the rank cost's keys, as the engine's are checked
    for key in _FLOAT_KEYS:
        if key in values and key not in COST_KEYS:
            problems += number_problems(prefix + key, values[key])
    for key in _INT_KEYS:
        if key in values:
            problems += number_problems(prefix + key, values[key], integer=True)
    threshold = values.get("hit_rate_threshold", 0.0)
    if _is_number(threshold) and threshold > 1:
        problems.append(f"{prefix}hit_rate_threshold is {threshold}: it is a ratio, use a value in [0, 1] (0 = off)")
    block_size = values.get("block_size", 128)
    if _is_number(block_size) and block_size == 0:
        problems.append(f"{prefix}block_size is 0: set it to the engine's page size (e.g. 128)")
    return problems


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# --------------------------------------------------------------------------- fold and cost


def weighted_blocks(hit: TierCounts, cfg: KvAffinityConfig) -> float:
    return hit.npu_blocks * cfg.w_npu + hit.cpu_blocks * cfg.w_cpu + hit.disk_blocks * cfg.w_disk


def matched_tokens(hit: TierCounts | None, cfg: KvAffinityConfig, isl: int) -> int:
    """Motor's ``min(round(weighted_blocks * block_size), isl)``; 0 without a hit."""
    if hit is None:
        return 0
    return min(round(weighted_blocks(hit, cfg) * cfg.block_size), isl)


def prefill_cost(matched: int, cfg: KvAffinityConfig, isl: int) -> float:
    return max(0.0, isl - cfg.overlap_credit * matched)


@dataclasses.dataclass(frozen=True)
class FoldedHit(TierHit):
    """The best engine rank of one instance and that rank's own tier split."""

    dp_rank: int = 0
    weighted: float = 0.0


def fold_engine_dps(hits: Mapping[int, TierCounts], cfg: KvAffinityConfig) -> FoldedHit | None:
    """The rank with the longest weighted hit; ``None`` when no rank holds any block.

    Ties on the weighted hit go to the rank with more NPU blocks (a hit already in HBM
    needs no load-back), then more blocks overall, then the lower rank (deterministic).
    One rank's figures are reported as they are: blocks held by different ranks are never
    added up, because a request runs on one rank.
    """
    found = best_rank(hits, cfg)
    if found is None:
        return None
    rank, hit, weighted = found
    return FoldedHit(hit.npu_blocks, hit.cpu_blocks, hit.disk_blocks, dp_rank=rank, weighted=weighted)


def best_rank(hits: Mapping[int, TierCounts], cfg: KvAffinityConfig) -> tuple[int, TierCounts, float] | None:
    """:func:`fold_engine_dps` without building a :class:`FoldedHit`: ``(rank, hit, weighted)``."""
    w_npu, w_cpu, w_disk = cfg.w_npu, cfg.w_cpu, cfg.w_disk
    best: TierCounts | None = None
    best_w = 0.0
    best_npu = best_total = best_rank_ = 0
    for rank, hit in hits.items():  # hot: every instance's ranks on every query, no allocation per rank
        npu, cpu, disk = hit.npu_blocks, hit.cpu_blocks, hit.disk_blocks
        weighted = npu * w_npu + cpu * w_cpu + disk * w_disk  # == weighted_blocks(hit, cfg)
        if best is not None and weighted < best_w:
            continue
        total = npu + cpu + disk
        if total <= 0:
            continue
        # (weighted, npu, total, -rank) compared lexicographically; ties are the rare case.
        if best is None or weighted > best_w or (npu, total, -rank) > (best_npu, best_total, -best_rank_):
            best, best_w, best_npu, best_total, best_rank_ = hit, weighted, npu, total, rank
    if best is None:
        return None
    return best_rank_, best, best_w


# --------------------------------------------------------------------------- decision


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A prefill instance (one HTTP endpoint) and its live load in Motor's token units."""

    instance_id: str
    load: float
    endpoint: Union[str, None] = None


@dataclasses.dataclass(frozen=True)
class CandidateScore:
    """One candidate's figures; tier fields are tokens (blocks * block_size).

    ``score`` is the unified formula's value in both modes (load_gated ranks by
    ``(-matched, load)`` among the ``gate_topn`` least loaded; the rest are ``gated_out``).
    """

    instance_id: str
    endpoint: Union[str, None]
    load: float
    dp_rank: Union[int, None]
    matched: int
    hbm: int
    cpu: int
    disk: int
    prefill_cost: float
    score: float
    gated_out: bool = False


@dataclasses.dataclass(frozen=True)
class Decision:
    """Where one request goes and why, as Motor logs it.

    ``dp_rank`` is the engine rank to pin (``routed_dp_rank`` / ``X-Data-Parallel-Rank``);
    ``None`` lets the engine's DP controller choose (no hit, or load balance).
    ``matched``/``hbm``/``cpu``/``disk`` are ``None`` under ``load_balance``, like Motor's log.
    """

    instance_id: str
    dp_rank: Union[int, None]
    policy: str
    matched: Union[int, None]
    hbm: Union[int, None]
    cpu: Union[int, None]
    disk: Union[int, None]
    score: Union[float, None]
    load: float
    reason: Union[str, None] = None
    endpoint: Union[str, None] = None
    isl: int = 0
    mode: str = "unified"
    fast_path: bool = False
    candidates: tuple[CandidateScore, ...] = ()

    def log_line(self, role: str = "prefill", req_id: str = "-") -> str:
        fields: list[tuple[str, object]] = [
            ("role", role),
            ("req_id", req_id),
            ("instance", self.instance_id),
        ]
        if self.endpoint is not None:
            fields.append(("endpoint", self.endpoint))
        fields += [
            ("policy", self.policy),
            ("matched", self.matched),
            ("hbm", self.hbm),
            ("cpu", self.cpu),
            ("disk", self.disk),
            ("dp_rank", self.dp_rank),
            ("load", self.load),
            ("score", self.score),
        ]
        if self.fast_path:
            fields.append(("fast_path", True))
        if self.reason is not None:
            fields.append(("reason", f'"{self.reason}"' if " " in self.reason else self.reason))
        return "scheduled " + " ".join(f"{key}={value}" for key, value in fields)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["candidates"] = [dataclasses.asdict(c) for c in self.candidates]
        return data


def select(
    cfg: KvAffinityConfig,
    candidates: Sequence[Candidate],
    hits_by_instance: Mapping[str, Mapping[int, TierCounts]] | None,
    isl: int,
) -> Decision:
    """Motor's kv_cache_affinity choice among ``candidates`` for a prompt of ``isl`` tokens.

    ``hits_by_instance`` holds an entry (possibly empty: known, no hit) for every instance
    the index knows; a candidate without an entry is skipped, as Motor skips an instance
    the conductor does not list. ``None`` means no index data at all. Falls back to
    load_balance (least loaded, first on ties) when there are no tokens, no index data
    for any candidate, or the best hit rate is at or below ``hit_rate_threshold``. A prompt
    shorter than one block skips the index (Motor's fast path: all-zero matches, still
    ranked by load, policy kv_cache_affinity). All-zero matches do not fall back.
    """
    if not candidates:
        raise ValueError("select needs at least one candidate")
    if isl <= 0:
        return _load_balance(cfg, candidates, isl, "no token ids")
    fast_path = isl < cfg.block_size
    if fast_path:
        scored = [_score(cfg, c, None, isl) for c in candidates]
    else:
        if hits_by_instance is None:
            return _load_balance(cfg, candidates, isl, "no index data")
        known = [c for c in candidates if c.instance_id in hits_by_instance]
        if not known:
            return _load_balance(cfg, candidates, isl, "no index data for any candidate")
        scored = [_score(cfg, c, fold_engine_dps(hits_by_instance[c.instance_id], cfg), isl) for c in known]
    if cfg.hit_rate_threshold > 0:
        hit_rate = max(s.matched for s in scored) / isl
        if hit_rate <= cfg.hit_rate_threshold:
            reason = f"hit rate {hit_rate:.3f} <= hit_rate_threshold {cfg.hit_rate_threshold}"
            return _load_balance(cfg, candidates, isl, reason)
    ranked = _rank(cfg, scored)
    best = ranked[0]
    return Decision(
        instance_id=best.instance_id,
        dp_rank=best.dp_rank,
        policy=POLICY_AFFINITY,
        matched=best.matched,
        hbm=best.hbm,
        cpu=best.cpu,
        disk=best.disk,
        score=best.score,
        load=best.load,
        reason="prompt shorter than one block" if fast_path else None,
        endpoint=best.endpoint,
        isl=isl,
        mode=cfg.mode,
        fast_path=fast_path,
        candidates=tuple(ranked),
    )


def _score(cfg: KvAffinityConfig, cand: Candidate, folded: FoldedHit | None, isl: int) -> CandidateScore:
    matched = matched_tokens(folded, cfg, isl)
    cost = prefill_cost(matched, cfg, isl)
    bs = cfg.block_size
    return CandidateScore(
        instance_id=cand.instance_id,
        endpoint=cand.endpoint,
        load=cand.load,
        # Pinning a rank only pays when the weighted hit is worth something.
        dp_rank=folded.dp_rank if folded is not None and matched > 0 else None,
        matched=matched,
        hbm=folded.npu_blocks * bs if folded else 0,
        cpu=folded.cpu_blocks * bs if folded else 0,
        disk=folded.disk_blocks * bs if folded else 0,
        prefill_cost=cost,
        score=cfg.prefill_load_scale * cost + cfg.load_weight * cand.load,
    )


def _rank(cfg: KvAffinityConfig, scored: list[CandidateScore]) -> list[CandidateScore]:
    """Best first; Python's stable sort keeps candidate order on ties, as Motor's does."""
    if cfg.mode == "unified":
        return sorted(scored, key=lambda s: s.score)
    gate = set(sorted(range(len(scored)), key=lambda i: scored[i].load)[: cfg.gate_topn])
    kept = [s for i, s in enumerate(scored) if i in gate]
    dropped = [dataclasses.replace(s, gated_out=True) for i, s in enumerate(scored) if i not in gate]
    return sorted(kept, key=lambda s: (-s.matched, s.load)) + sorted(dropped, key=lambda s: s.load)


def _load_balance(cfg: KvAffinityConfig, candidates: Sequence[Candidate], isl: int, reason: str) -> Decision:
    best = min(candidates, key=lambda c: c.load)  # min keeps the first on ties
    return Decision(
        instance_id=best.instance_id,
        dp_rank=None,
        policy=POLICY_LOAD_BALANCE,
        matched=None,
        hbm=None,
        cpu=None,
        disk=None,
        score=None,
        load=best.load,
        reason=reason,
        endpoint=best.endpoint,
        isl=isl,
        mode=cfg.mode,
    )


# --------------------------------------------------------------------------- conductor view


def conductor_response(
    hits_by_instance: Mapping[str, Mapping[int, TierCounts]],
    registered_dps: Mapping[str, Iterable[int]] | None,
    block_size: int,
    tenant: str = "default",
    fold: bool = True,
    cfg: KvAffinityConfig | None = None,
    shape: str = "tokens",
) -> dict[str, dict[str, dict[str, Any]]]:
    """kv-conductor's ``/query`` body: ``{tenant: {instance: {"longest_matched", "DP": {...}}}}``.

    Every registered dp is listed, zeros included, as the conductor lists registered DPs.
    With ``fold`` and an instance registered under ONE dp (Motor registers dp 0 for the
    single endpoint of an SGLang instance), the engine ranks are folded into that key and
    ``engine_dp_rank`` names the rank the figures belong to. Otherwise each registered dp
    reports the engine rank of the same number (vLLM-style one endpoint per rank, or an
    engine without the plugin registered per rank). ``matched_tokens`` is unweighted
    (conductor semantics: Motor applies its weights); the fold picks the rank with
    ``cfg``'s weights (Motor's defaults without one). Without ``registered_dps`` every
    instance with hits is listed, under dp 0 when folding, else under its engine ranks.
    Each instance's entry is laid out by :func:`instance_entry` in ``shape``.
    """
    weights = cfg or KvAffinityConfig(block_size=block_size)
    if shape not in QUERY_SHAPES:
        raise ValueError(f"shape must be one of {', '.join(QUERY_SHAPES)}, got {shape!r}")
    instances = list(registered_dps) if registered_dps is not None else list(hits_by_instance)
    out: dict[str, dict[str, Any]] = {}
    for instance in instances:
        hits = hits_by_instance.get(instance, {})
        dps = _listed_dps(instance, hits, registered_dps, fold)
        entries: dict[str, dict[str, Any]] = {}
        if fold and len(dps) == 1:
            found = best_rank(hits, weights)
            rank, hit = (found[0], found[1]) if found else (None, None)
            entries[str(dps[0])] = dp_entry(hit, rank, block_size)
        else:
            for dp in dps:
                entries[str(dp)] = dp_entry(hits.get(dp), dp, block_size)
        out[instance] = instance_entry(entries, weights, block_size, shape)
    return {tenant: out}


def _listed_dps(
    instance: str, hits: Mapping[int, TierCounts], registered_dps: Mapping[str, Iterable[int]] | None, fold: bool
) -> list[int]:
    if registered_dps is not None:
        return sorted(set(registered_dps[instance]))
    return [0] if fold else sorted(hits)


def dp_entry(hit: TierCounts | None, engine_rank: int | None, block_size: int) -> dict[str, Any]:
    """One ``DP`` entry of a conductor answer (all zeros for no hit)."""
    npu, cpu, disk = (hit.npu_blocks, hit.cpu_blocks, hit.disk_blocks) if hit is not None else (0, 0, 0)
    return {
        "matched_tokens": (npu + cpu + disk) * block_size,
        "npu_blocks": npu,
        "cpu_blocks": cpu,
        "disk_blocks": disk,
        "engine_dp_rank": engine_rank,
    }


# ``/query`` answer layouts (docs/motor.md "What each Motor reads"):
# - "tokens" (default): ``DP[<dp>]`` is an int of matched tokens - the one form every released
#   Motor scores: 3.0.0b2 compares it with ``<``, the Ascend source takes ``min(DP, isl)``, the
#   dict-per-rank forks read an int as tokens. The per-rank figures move to ``dp_detail``.
# - "rank_dicts": ``DP[<dp>]`` is the per-rank dict, for the forks that weight tiers themselves
#   (``npu_blocks * w_npu + ...``); 3.0.0b2 and the Ascend source raise TypeError on it.
QUERY_SHAPES: tuple[str, ...] = ("tokens", "rank_dicts")


def instance_entry(
    entries: Mapping[str, dict[str, Any]], cfg: KvAffinityConfig, block_size: int, shape: str = "tokens"
) -> dict[str, Any]:
    """One instance of a ``/query`` answer from its :func:`dp_entry` dicts (keyed by dp).

    Always: ``longest_matched`` (unweighted tokens, conductor semantics) and ``GPU`` / ``CPU`` /
    ``DISK`` - the tier tokens of the dp with the longest weighted hit (3.0.0b2 ranks
    instances by ``GPU``, an int). ``DP`` as ``shape`` says; with "tokens" each value is
    Motor's matched tokens under ``cfg``'s weights, ``round(weighted_blocks * block_size)``.
    """
    bs = block_size
    longest = 0
    best: dict[str, Any] | None = None
    best_w = 0.0
    w_npu, w_cpu, w_disk = cfg.w_npu, cfg.w_cpu, cfg.w_disk
    weights: dict[str, float] = {}  # on every /query: weighted once per entry, no TierHit built
    for dp, entry in entries.items():
        longest = max(longest, entry["matched_tokens"])
        weighted = weights[dp] = (
            entry["npu_blocks"] * w_npu + entry["cpu_blocks"] * w_cpu + entry["disk_blocks"] * w_disk
        )
        if best is None or weighted > best_w:
            best, best_w = entry, weighted
    out: dict[str, Any] = {
        "longest_matched": longest,
        "GPU": best["npu_blocks"] * bs if best else 0,
        "CPU": best["cpu_blocks"] * bs if best else 0,
        "DISK": best["disk_blocks"] * bs if best else 0,
    }
    if shape == "rank_dicts":
        out["DP"] = dict(entries)
        return out
    out["DP"] = {dp: round(weighted * bs) for dp, weighted in weights.items()}
    out["dp_detail"] = dict(entries)
    return out


# --------------------------------------------------------------------------- the rank that serves

# How far Motor's own load book may favour another instance before its cost stops following the
# adapter's pick (motor_values), in tokens: above any book, which sums the prompts in flight.
MOTOR_BOOK_MARGIN = 1 << 31


@dataclasses.dataclass(frozen=True)
class RankScored:
    """One instance scored by the rank that would serve the request (``rank_cost.score_ranks``):
    that rank, its hit and matched tokens, its cost (prefill part + that rank's load), and the
    instance's summed rank loads - what Motor's own per-instance load term is taken to be."""

    rank: Union[int, None]
    hit: Union[TierCounts, None]
    matched: int
    cost: float
    load_estimate: float = 0.0
    load: float = 0.0  # the chosen rank's own load


def pick_instance(scored: Sequence[RankScored], spread: int) -> int:
    """The index of the lowest cost; equal costs go to the one ``spread``'s high 32 bits name
    among them.  The dispatcher starts its scan over the ranks at ``spread`` modulo their
    number (rank_cost.spread_start): naming the instance by the same low bits would tie it to
    the rank - with two instances of 16 ranks, instance 0 would start cold prompts only on even
    ranks and instance 1 only on odd ones, half the ranks taking every tie."""
    if not scored:
        raise ValueError("pick_instance needs at least one instance")
    low = min(s.cost for s in scored)
    tied = [i for i, s in enumerate(scored) if s.cost == low]
    return tied[(spread >> 32) % len(tied)]


def motor_values(
    scored: Sequence[RankScored],
    best: int,
    cfg: KvAffinityConfig,
    isl: int,
    fresh: Union[Sequence[bool], None] = None,
) -> tuple[list[int], list[int]]:
    """The ints Motor reads per instance - ``(DP, GPU)`` - so that its unchanged cost picks
    ``scored[best]`` and, under the Ascend source's cost, ranks the others by their cost.

    * ``DP`` (the Ascend source): Motor computes ``prefill_load_scale * max(0, isl -
      overlap_credit * min(DP, isl)) + load_weight * load``.  With ``T = cost -
      load_weight * load_estimate`` (Motor adds its own instance load, estimated by the summed
      rank loads), ``DP = matched_best - (T - T_best) / (prefill_load_scale * overlap_credit)``,
      at most ``isl``: Motor's scores then differ as the costs do.  The best instance shows its
      real matched tokens (Motor's log line shows the true hit); another instance may get a
      value below 0 - the Ascend source takes ``min(DP, isl)`` and ``max(0, isl - credit * DP)``,
      so a negative value costs more than a miss, which is what keeps Motor's instance-load
      term from outweighing a rank's hit and load (3.0.0b2 reads ``DP`` of the instance it
      picked by ``GPU`` only: the best, never negative).
      Motor's load is not the summed rank loads, though, but its own book: MindIE Motor 3.1
      commits ``isl - matched`` of each prefill it routes to the endpoint and releases it when
      the prefill leg returns (3.0.0: ``len(token_ids)`` and 0.3 times it, released at the
      request's end).  That book lags and leads the engine's queue by whole prompts, and the
      adapter cannot read it.  So when the best and another instance both have fresh load
      figures (``fresh``; None: all of them), the other's ``DP`` is lowered by a further
      :data:`MOTOR_BOOK_MARGIN` tokens of Motor's load: Motor's cost then follows the
      adapter's rank-level choice for any book gap below it, and still ranks the others among
      themselves by their cost.  An instance without fresh figures keeps the plain value, so
      Motor's own load still weighs against a stale view.
    * ``GPU`` (3.0.0b2: the instance with the largest ``GPU``, ignoring negative values, and no
      load term): the best instance its real matched tokens (at least 1 when there are others,
      so a cold best still wins), every other instance its real matched tokens kept below that.
    """
    n = len(scored)
    top = scored[best]
    gpu = [0] * n
    gpu_best = max(top.matched, 1) if n > 1 and isl > 0 else top.matched  # 1: a cold best beats the others
    for i, s in enumerate(scored):
        gpu[i] = gpu_best if i == best else max(0, min(s.matched, gpu_best - 1))
    scale = cfg.prefill_load_scale * cfg.overlap_credit
    if scale <= 0:  # Motor ignores the hit: report it as it is
        return [min(s.matched, isl) for s in scored], gpu
    weight = cfg.load_weight
    targets = [s.cost - weight * s.load_estimate for s in scored]
    t_best = targets[best]
    anchor = float(min(top.matched, isl))
    margin = MOTOR_BOOK_MARGIN * weight / scale
    dp = [0] * n
    for i, t in enumerate(targets):
        v = anchor - (t - t_best) / scale
        if i != best and (fresh is None or (fresh[i] and fresh[best])):
            v -= margin
        dp[i] = round(min(v, float(isl)))
    dp[best] = round(anchor)
    return dp, gpu
