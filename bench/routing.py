"""Routing quality on the public Mooncake traces: a discrete-event simulation of P prefill instances x R DP ranks.

    python bench/routing.py [--trace FILE | --workload agentic [--sessions 1200] | --workload rollout]
                            [--instances 2] [--ranks 16]
                            [--capacity-pages 4096] [--load 0.6] [--limit N] [--policies a,b,...] [--seed 0]
                            [--out-dir bench/results]

Prints one JSON line per policy (`{"bench": "routing", "trace", "policy", "code", "hit_ratio", "prefill_tokens",
"ttft_p50_s", "ttft_p90_s", "hit_ratio_vs_oracle", "targets", ...}`), writes them to
bench/results/routing_<trace>.jsonl and draws bench/results/routing_<trace>.png (skipped with a note on stderr
when matplotlib is not installed).
`hit_ceiling` (every line) is the hit ratio of one unlimited cache shared by all ranks: no placement beats it.

Model (every choice below is a documented default, overridable on the command line):
- Workload: each trace record is one prefill request of `input_length` tokens whose `hash_ids` are 512-token
  blocks. Block i (id b) is split into 4 pages of 128 tokens; page j of block i gets the prefix-chained key
  hash((key of the previous page, b, j)), so two prompts share page keys exactly as long as they share their
  prefix. Only full pages are cached (SGLang caches whole pages).
- Cluster: P instances x R ranks, each rank a `RankCache` (sglang_kvpub/tools/sim_cache.py: finite capacity in pages,
  LRU eviction of unreferenced leaves) and a FIFO single-server queue. Default capacity 4096 pages (512k tokens) per
  rank: 2 x 16 x 4096 = 131k pages, about 18% of the conversation trace's 731k distinct pages, so the working
  set does not fit and eviction matters.
- Prefill time = uncached tokens / rank throughput. Default throughput 5000/7 = 714 tokens/s per rank, from the
  report: a ~5k-token prompt took ~9 s end to end cold and ~2 s hot, i.e. ~7 s is the prefill of ~5k uncached
  tokens (the ~2 s floor is outside prefill and the same for every policy, so it is left out). TTFT = queue
  wait + prefill time. A rank's cache is read when the request starts (all earlier requests on that rank have
  finished and inserted their pages), and the request's pages are inserted when its prefill finishes - which
  is also when the engine publishes BlockStored, so routers see a page from that moment on.
- Load: `--load` is the offered load as a fraction of the aggregate prefill capacity P*R*throughput, counting
  every prompt token as uncached (a cold cluster). Trace timestamps are scaled by one factor to reach it; hits
  lower the effective load, so a good policy also queues less. Default 0.6: at the default throughput the
  conversation trace's real timestamps are a load of 0.57.
- Rank load, in tokens queued: the prefill tokens still to compute on a rank, as the engine reports it
  (SGLang's per-rank load figures) - the uncached tokens of its waiting requests (matched against the rank's
  cache when they were enqueued) plus the remainder of the running prefill. What the instance's dispatcher and
  the fan-in's rank-load message carry, and the instance load (the sum over its ranks) of the model_*
  baselines and load_balance.
- Motor's load (every shipped policy: Motor, or KvAffinity.select standing in for it, picks the instance):
  Motor's OWN book per prefill endpoint, not the engine's figures. The report's deployment runs MindIE Motor
  3.1 (Ascend/MindIE-Motor), whose book is modelled: after an affinity pick the scheduler commits
  calculate_committed_workload(role, isl, matched) = isl - min(matched, isl), matched being the answer's
  figure for the picked endpoint (motor/coordinator/domain/workload_calculator.py; the scheduler passes
  matched_tokens_map[(instance, endpoint)]); the endpoint's score is Workload.calculate_workload_score =
  active_tokens for every role (motor/common/resources/endpoint.py); UnifiedPDRouter releases the prefill
  leg's tokens (WorkloadAction.RELEASE_TOKENS) as soon as the prefill task returns, before decode ends
  (motor/coordinator/router/strategies/unified_pd.py). Here: committed at dispatch, released when the
  prefill finishes (Cluster.motor_commit / _finish). MindIE PyMotor 3.0.0 (Ascend/MindIE-PyMotor) kept a
  different book - len(token_ids) to active_tokens and active_kv_cache, scored active_tokens + 0.3 *
  active_kv_cache, released when pd_dual_dispatch's resource context closes at the request's end - for a
  Motor that is no longer the report's; default_motor_b2 reads the 3.1 book too (only its load_balance
  fallback reads a load). The book holds a whole prompt from routing to the end of its prefill, where
  the engine's figure counts only what is left, so the two differ by whole prompts: the adapter's answer
  keeps Motor's cost on its own pick whatever the book holds (scoring.motor_values).

Token ids and events (the shipped policies): page j of trace block b carries 128 token ids that are a fixed
function of (b, j) (SHAKE-128 of the pair), so prompts share token ids exactly where they share blocks and the
product's XXH3 block keys chain like the page keys above. When a prefill finishes, its rank publishes what an
SGLang rank publishes: one BlockRemoved for the pages its LRU evicted, one BlockStored for the new pages (engine
block hashes = the page keys, parent = the page before them, their token ids), as one batch tagged with the rank.
Each batch is encoded with wire.BatchEncoder (the fan-in's instance stream) and decoded with wire.BatchDecoder
(the router's subscriber), then applied as the stream subscriber applies it: PrefixIndex.apply_batch of the
router's KvAffinity, and CacheAwareDispatcher.observe of the instance's dispatcher.

Workloads: a Mooncake trace (--trace), or --workload agentic: agentic multi-turn sessions generated from --seed
(agentic_records: a few long shared system prompts, each session's history growing turn by turn, think time
between turns, many sessions interleaved), reported as trace "agentic_sessions", or --workload rollout: RL
rollout bursts generated from --seed (rollout_records: 24 steps x 32 prompts x GRPO groups of 8 identical
prompts sent at once, a 3k-token shared instruction prompt, 0.5-4.5k-token questions), reported as "rollout".

Policies (each on a fresh cluster, same arrivals). The shipped code (JSON field "code": "shipped"):
- default: what operators get. motor-kv-adapter's state (AdapterState.answer_keys: /query's answer, each instance
  registered as Motor registers it, fed the ranks' events and, every load_report_s of simulated time, each
  instance's rank-load message - wire.LoadReport through its codec - with the ranks' queued prefill tokens then);
  Motor's unchanged kv_cache_affinity over that answer (a model of the Ascend source's code, motor_ascend_pick:
  min(DP, isl), unified cost with Motor's own book as the load, then the book's commit of isl - DP); the
  instance's real CacheAwareDispatcher picks the rank with fresh loads.  Its JSON line also gives rank_agreement
  (how often the dispatcher took the rank the adapter scored the picked instance by), best_other_shipped(_hit_ratio)
  and oracle_ttft_p50_s/p90_s (its targets).
- default_motor_b2: the same with mindie-motor 3.0.0b2's reading of the answer (motor_b2_pick: the largest GPU).
- dp0_only: the report's bug. motor_adapter's KvAffinity.select (Motor's kv_cache_affinity, unified cost over
  each instance's folded hit and its load) over an index fed ONLY rank 0's stream of each instance; rank
  round-robin inside.
- instance_affinity: the upstream fix. KvAffinity.select over every rank's stream picks the instance; rank
  round-robin inside (SGLang's default DP dispatch).
- fold_pinned: ours at the router. KvAffinity.select picks the instance AND pins the rank its fold names
  (Decision.dp_rank = routed_dp_rank: the rank with the longest hit); round-robin when nothing is matched.
  Motor's load is per instance (one endpoint per instance): the pinned rank's own queue is not in the cost.
- fold_pinned_dispatch: KvAffinity.select picks the instance (no pin); inside the instance the real
  CacheAwareDispatcher (fed the same rank events) picks the rank from its index and the rank loads (same load
  signal as below). Its JSON line also reports the ratios against instance_affinity, the same router with
  SGLang's round-robin dispatch.
Baselines (JSON "code": "model"):
- round_robin: instance round-robin, rank round-robin inside (SGLang's default DP dispatch).
- load_balance: least-loaded instance, rank round-robin inside.
- model_dp0_only, model_instance_affinity, model_fold_pinned, model_fold_pinned_dispatch: the earlier models of
  the four policies above (the rank caches read directly, Motor's unified cost written out here).
  model_fold_pinned scores every (instance, rank) with the RANK's load: prefill_load_scale * max(0, isl -
  overlap_credit * matched_rank) + load_weight * load_rank, pinned to the best rank; `--hotspot-tokens T` adds
  a guard (if the chosen rank's load exceeds the least-loaded rank's by more than T tokens, take the cheapest
  rank among those within T). model_fold_pinned_dispatch: the instance as model_instance_affinity, the rank
  by the same per-rank cost.
- oracle: perfect knowledge, no lookahead into future arrivals. At dispatch it knows, for every rank, (a) the
  exact prefix it will hold when this request starts there: its cache now plus the pages of every request
  already queued or running on it (inserted before this one starts; evictions in between ignored), and
  (b) the exact wait: when that rank's queue empties, from the true uncached tokens of those requests.
  It picks the rank of least exact TTFT: max(0, isl - future hit) + wait in tokens (Motor's unified cost
  with exact inputs), ties rotating. It is the per-request best a scheduler can do; the routers' policies
  see only published (finished) pages and the engine-reported loads.
- oracle_max_prefix (diagnostic, only if named in --policies): the same knowledge, longest future prefix
  first, ties by least wait - the literal "max cached prefix" rule. It collapses: every conversation-trace
  prompt starts with the same block, so the first rank that holds it wins every request after (one rank
  serves the whole trace, hit ratio below round robin, queues of days). Hence the oracle above.

Motor's cost constants are fixed to its defaults: overlap_credit = prefill_load_scale = load_weight = 1,
w_npu = 1 (only HBM is modelled), block_size (page) = 128; matched = min(pages * 128, isl).
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import math
import random
import struct
import sys
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:  # bench/ is a folder of scripts: the repository root holds the packages
    sys.path.insert(0, str(_HERE.parent))

from bench._common import MOONCAKE_TRACES, with_targets  # noqa: E402
from motor_adapter.affinity import KvAffinity, NoSubscriber  # noqa: E402
from motor_adapter.registration import parse_registration  # noqa: E402
from motor_adapter.scoring import Candidate, KvAffinityConfig  # noqa: E402
from motor_adapter.settings import ServiceConfig  # noqa: E402
from motor_adapter.state import AdapterState  # noqa: E402
from sglang_kvpub import wire  # noqa: E402
from sglang_kvpub.config import PluginConfig  # noqa: E402
from sglang_kvpub.core.dispatch import CacheAwareDispatcher  # noqa: E402
from sglang_kvpub.core.hashing import sequence_keys  # noqa: E402
from sglang_kvpub.core.rank_cost import spread_key  # noqa: E402
from sglang_kvpub.tools.sim_cache import RankCache  # noqa: E402

TRACE_BLOCK_TOKENS = 512
PAGE_SIZE = 128
DEFAULT_TOKENS_PER_S = 5000.0 / 7.0
DEFAULT_CAPACITY_PAGES = 4096
OVERLAP_CREDIT = 1.0
PREFILL_LOAD_SCALE = 1.0
LOAD_WEIGHT = 1.0
ALL_POLICIES = (
    "default",
    "default_motor_b2",
    "round_robin",
    "load_balance",
    "dp0_only",
    "instance_affinity",
    "fold_pinned",
    "fold_pinned_dispatch",
    "model_dp0_only",
    "model_instance_affinity",
    "model_fold_pinned",
    "model_fold_pinned_dispatch",
    "oracle",
)
# Policies that run the shipped code (motor_adapter's KvAffinity, sglang_kvpub's dispatcher);
# the model_* policies are the earlier models of the same ideas, kept as baselines.
SHIPPED_POLICIES = (
    "default",
    "default_motor_b2",
    "dp0_only",
    "instance_affinity",
    "fold_pinned",
    "fold_pinned_dispatch",
)
# What operators get by default: Motor's unchanged kv_cache_affinity over the adapter's /query
# answer (which scores each instance by the rank that would serve the request, from the rank
# loads on the stream), then the plugin's cache-aware dispatcher inside the instance.
DEFAULT_POLICIES = ("default", "default_motor_b2")
MODEL = "bench-model"
TENANT = "default"
LOAD_REPORT_S = PluginConfig().load_report_s  # the fan-in's rank-load message period (shipped default)
EXTRA_POLICIES = ("oracle_max_prefix",)  # diagnostics, only when named in --policies
REPO_ROOT = _HERE.parent
DEFAULT_TRACE = MOONCAKE_TRACES / "conversation_trace.jsonl"


# ------------------------------------------------------------------------------------------ workload
@dataclass(frozen=True)
class Request:
    arrival_s: float
    isl: int
    keys: tuple[int, ...]  # prefix-chained page keys of the full pages
    hash_ids: tuple[int, ...] = ()  # the trace's 512-token block ids: the token ids derive from them


def page_keys(hash_ids: Sequence[int], input_length: int, page_size: int = PAGE_SIZE) -> tuple[int, ...]:
    """Chained page keys of a Mooncake record: page j of block b keyed by hash((previous key, b, j))."""
    per_block = TRACE_BLOCK_TOKENS // page_size
    n_pages = input_length // page_size
    keys: list[int] = []
    key = 0
    for i in range(n_pages):
        block = hash_ids[i // per_block] if i // per_block < len(hash_ids) else -1 - i
        key = hash((key, block, i % per_block))  # tuples of ints hash deterministically across runs
        keys.append(key)
    return tuple(keys)


def load_trace(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Records of a Mooncake jsonl trace (timestamp ms, input_length, output_length, hash_ids)."""
    if not path.is_file():
        raise FileNotFoundError(
            f"trace not found: {path} (the Mooncake traces ship with the repository in {MOONCAKE_TRACES}; "
            "pass --trace FILE for another)"
        )
    records: list[dict[str, Any]] = []
    with path.open() as fh:
        for line in fh:
            if not line.strip():
                continue
            records.append(json.loads(line))
            if limit is not None and len(records) >= limit:
                break
    if not records:
        raise ValueError(f"trace {path} has no records")
    return records


def build_requests(
    records: Sequence[dict[str, Any]], capacity_tokens_per_s: float, load: float, page_size: int = PAGE_SIZE
) -> tuple[list[Request], float]:
    """Requests with arrivals scaled so the cold offered load is `load` x capacity; returns (requests, scale)."""
    t0 = min(r["timestamp"] for r in records) / 1000.0
    span = max(r["timestamp"] for r in records) / 1000.0 - t0
    total_tokens = sum(int(r["input_length"]) for r in records)
    target_span = total_tokens / (load * capacity_tokens_per_s)
    scale = target_span / span if span > 0 else 1.0
    reqs = [
        Request(
            arrival_s=(r["timestamp"] / 1000.0 - t0) * scale,
            isl=int(r["input_length"]),
            keys=page_keys(r["hash_ids"], int(r["input_length"]), page_size),
            hash_ids=tuple(r["hash_ids"]),
        )
        for r in records
    ]
    reqs.sort(key=lambda q: q.arrival_s)  # stable: trace order kept for equal timestamps
    return reqs, scale


def hit_ceiling(requests: Sequence[Request], page_size: int = PAGE_SIZE) -> float:
    """Hit ratio of one shared cache of unlimited size, pages visible from arrival: no placement beats it."""
    seen: set[int] = set()
    cached = total = 0
    for req in requests:
        n = 0
        for key in req.keys:
            if key not in seen:
                break
            n += 1
        cached += min(n * page_size, req.isl)
        total += req.isl
        seen.update(req.keys)
    return cached / total if total else 0.0


# ------------------------------------------------------------------------------------------ agentic workload
AGENTIC = "agentic_sessions"  # the "trace" name of the generated workload


def agentic_records(
    seed: int, sessions: int = 1200, system_prompts: int = 4, span_s: float = 3600.0, max_isl: int = 32768
) -> list[dict[str, Any]]:
    """Agentic multi-turn sessions, generated from ``seed``, as Mooncake records.

    A few long shared system prompts (3-8k tokens, whole 512-token blocks; chosen with weights
    1, 1/2, 1/3, ...), each session's history growing turn by turn (a user message or a tool
    result, 30-3,000 tokens, then the answer, 50-600 tokens, joins the history), think time
    between turns (the answer's decode at 40 tokens/s plus an exponential pause of mean 8 s),
    sessions starting uniformly over ``span_s`` and so interleaved.  A session ends after
    2-12 turns or at ``max_isl``.  Block ids follow the session's token stream in 512-token
    slots: a turn shares every full page of the previous turn's prompt, as a real chat
    template does when the history is only appended to."""
    rng = random.Random(seed)
    counter = iter(range(1 << 62))
    system = []
    for _ in range(system_prompts):
        blocks = rng.choice([6, 8, 12, 16])  # x 512 tokens
        system.append([next(counter) for _ in range(blocks)])
    weights = [1.0 / (k + 1) for k in range(system_prompts)]
    records: list[dict[str, Any]] = []
    for _ in range(sessions):
        blocks = list(rng.choices(system, weights)[0])
        tokens = len(blocks) * TRACE_BLOCK_TOKENS
        at = rng.uniform(0.0, span_s)
        for turn in range(rng.randint(2, 12)):
            added = rng.randint(200, 2000) if turn == 0 else rng.choice((rng.randint(30, 300), rng.randint(300, 3000)))
            tokens = _extend(blocks, tokens, added, counter)
            if tokens > max_isl:
                break
            output = rng.randint(50, 600)
            records.append({"timestamp": int(at * 1000), "input_length": tokens, "output_length": output,
                            "hash_ids": list(blocks)})  # fmt: skip
            tokens = _extend(blocks, tokens, output, counter)
            at += output / 40.0 + rng.expovariate(1.0 / 8.0)
    records.sort(key=lambda r: r["timestamp"])
    return records


ROLLOUT = "rollout"  # the "trace" name of the generated RL-rollout workload


def rollout_records(
    seed: int,
    steps: int = 24,
    prompts: int = 32,
    group: int = 8,
    shared_tokens: int = 3072,
    question_tokens: tuple[int, int] = (500, 4500),
    step_s: float = 100.0,
) -> list[dict[str, Any]]:
    """RL rollout bursts, generated from ``seed``, as Mooncake records.

    Every training step sends ``prompts`` prompts at once, each ``group`` times (a GRPO
    group: identical prompts), all under one shared instruction prompt of ``shared_tokens``
    (whole 512-token blocks), each prompt's question ``question_tokens`` long; then nothing
    until the next step, ``step_s`` later (build_requests rescales the span to the load).
    A step's requests share one timestamp, in a shuffled order: the members of a group reach
    the router while the first of them is still being prefilled."""
    rng = random.Random(seed)
    counter = iter(range(1 << 62))
    shared = [next(counter) for _ in range(-(-shared_tokens // TRACE_BLOCK_TOKENS))]
    records: list[dict[str, Any]] = []
    for step in range(steps):
        at = int(step * step_s * 1000)
        burst: list[dict[str, Any]] = []
        for _ in range(prompts):
            blocks = list(shared)
            tokens = _extend(blocks, len(shared) * TRACE_BLOCK_TOKENS, rng.randint(*question_tokens), counter)
            output = rng.randint(200, 2000)
            for _ in range(group):
                burst.append({"timestamp": at, "input_length": tokens, "output_length": output,
                              "hash_ids": list(blocks)})  # fmt: skip
        rng.shuffle(burst)  # sent concurrently: the router sees the step's requests in no group order
        records.extend(burst)
    return records


def _extend(blocks: list[int], tokens: int, added: int, counter: Any) -> int:
    """Appends ``added`` tokens to a history of ``tokens`` covered by ``blocks`` (512-token slots):
    a partly filled last slot keeps its id (its full pages are unchanged), new slots get new ids."""
    total = tokens + added
    while len(blocks) * TRACE_BLOCK_TOKENS < total:
        blocks.append(next(counter))
    return total


# ------------------------------------------------------------------------------------------ token ids
_PAGE_BYTES: dict[tuple[int, int, int], bytes] = {}
_PAGE_BYTES_MAX = 200_000  # ~100 MB of 128-token pages; rebuilt on demand past that


def page_block(req: Request, page: int, page_size: int = PAGE_SIZE) -> tuple[int, int]:
    """(trace block id, page within it) of a request's page - what ``page_keys`` chains."""
    per_block = TRACE_BLOCK_TOKENS // page_size
    block = req.hash_ids[page // per_block] if page // per_block < len(req.hash_ids) else -1 - page
    return block, page % per_block


def page_tokens(block: int, part: int, page_size: int = PAGE_SIZE) -> bytes:
    """The page's token ids as little-endian u32 bytes: a fixed function of (block id, page in
    block), so two prompts share token ids exactly where the trace says they share blocks."""
    key = (block, part, page_size)
    data = _PAGE_BYTES.get(key)
    if data is None:
        if len(_PAGE_BYTES) >= _PAGE_BYTES_MAX:
            _PAGE_BYTES.clear()
        data = _PAGE_BYTES[key] = hashlib.shake_128(struct.pack("<qqq", block, part, page_size)).digest(4 * page_size)
    return data


def request_tokens(req: Request, page_size: int = PAGE_SIZE) -> array[int]:
    """The request's ``isl`` token ids (u32): its full pages, then a partial page of zeros."""
    pages = b"".join(page_tokens(*page_block(req, i, page_size), page_size) for i in range(len(req.keys)))
    tokens = array("I", pages)
    tokens.extend([0] * (req.isl - len(tokens)))
    return tokens


def stored_events(req: Request, stored: Sequence[int], evicted: Sequence[int], page_size: int) -> list[Any]:
    """What the rank publishes when a prefill finishes, as SGLang's recorder coalesces it: the
    evicted pages as one ``BlockRemoved``, the new pages as one ``BlockStored`` (page keys as
    engine block hashes, the parent the page before the first new one, their token ids)."""
    events: list[Any] = []
    if evicted:
        events.append(wire.BlockRemoved(block_hashes=list(evicted), medium=wire.MEDIUM_GPU))
    if stored:
        first = req.keys.index(stored[0])
        raw = b"".join(
            page_tokens(*page_block(req, i, page_size), page_size) for i in range(first, first + len(stored))
        )
        events.append(
            wire.BlockStored(
                block_hashes=list(stored),
                parent_block_hash=req.keys[first - 1] if first else None,
                token_ids=array("I", raw).tolist(),
                block_size=page_size,
                medium=wire.MEDIUM_GPU,
            )
        )
    return events


class ShippedFeed:
    """The shipped router and dispatcher, fed the ranks' KV events through the real wire codec.

    Every batch a rank publishes is encoded (``wire.BatchEncoder``, the fan-in's instance
    stream), decoded (``wire.BatchDecoder``, the subscriber's decoder) and applied as
    ``StreamSubscriber`` applies it: ``PrefixIndex.apply_batch`` of one ``KvAffinity`` for the
    whole cluster (``router``), of one that sees only rank 0's stream (``dp0``: the report's
    bug), and ``CacheAwareDispatcher.observe`` of each instance's dispatcher (the fan-in's feed).
    """

    def __init__(
        self,
        instances: int,
        ranks: int,
        page_size: int,
        *,
        router: bool,
        dp0: bool,
        dispatch: bool,
        adapter: bool = False,
    ) -> None:
        cfg = KvAffinityConfig(block_size=page_size)
        self.page_size = page_size
        self.names = [f"instance-{i}" for i in range(instances)]
        self.encoder = wire.BatchEncoder()
        self.decoder = wire.BatchDecoder()
        self.loads_codec = wire.LoadReportCodec()  # the fan-in's encoder and the subscriber's decoder
        self.router = self._affinity(cfg) if router else None
        self.dp0 = self._affinity(cfg) if dp0 else None
        # The plugin's shipped setting: pending prefixes on (dp_pending).
        pending = PluginConfig().dp_pending
        self.dispatchers = (
            [CacheAwareDispatcher(ranks, page_size, pending=pending) for _ in range(instances)] if dispatch else []
        )
        self.adapter = self._adapter(cfg) if adapter else None
        self.batches = 0
        self.load_reports = 0
        self.agreed = self.compared = 0  # dispatcher's rank == the rank the adapter scored the instance by

    def _adapter(self, cfg: KvAffinityConfig) -> AdapterState:
        """``motor-kv-adapter serve``'s state, each instance registered as Motor registers it
        (one endpoint, dp 0; its stream carries every rank)."""
        state = AdapterState(
            ServiceConfig(kv_affinity=cfg),
            affinity_factory=lambda c, cap: KvAffinity(c, cap, subscriber_factory=NoSubscriber),
        )
        for i in range(len(self.names)):
            body = {"instance_id": f"vllm-prefill-{i}", "endpoint": self.stream(i), "type": "vLLM"}
            state.register(parse_registration({**body, "modelname": MODEL, "block_size": cfg.block_size, "dp_rank": 0}))
        return state

    @staticmethod
    def stream(instance: int) -> str:
        return f"tcp://10.0.0.{instance + 1}:5557"

    def adapter_affinity(self) -> KvAffinity:
        assert self.adapter is not None
        affinity = self.adapter.affinity(MODEL, TENANT, self.page_size)
        assert affinity is not None
        return affinity

    def report_loads(self, instance: int, loads: Sequence[float], ts: float) -> None:
        """One rank-load message of an instance: encoded as the fan-in encodes it, decoded as the
        adapter's subscriber decodes it, applied to the adapter's load book."""
        pending = self.dispatchers[instance].pending if self.dispatchers else None
        if pending is None:
            ranks = [wire.RankLoad(r, round(v, 1)) for r, v in enumerate(loads)]
        else:  # as the fan-in reports them (engine/load_report.py): riders off, pending keys on
            ranks = [
                wire.RankLoad(r, round(v, 1), pending=pending.keys_of(r, wire.MAX_PENDING_KEYS))
                for r, v in enumerate(pending.waits(loads))
            ]
        figures = wire.RankLoads(ranks, {}, LOAD_REPORT_S)
        report = self.loads_codec.decode(self.loads_codec.encode(ts, figures))
        assert report is not None
        self.adapter_affinity().loads.apply(self.stream(instance), report)
        self.load_reports += 1

    def _affinity(self, cfg: KvAffinityConfig) -> KvAffinity:
        affinity = KvAffinity(cfg, subscriber_factory=NoSubscriber)
        for name in self.names:
            affinity.add_instance(name, f"inproc://{name}")
        return affinity

    def publish(self, instance: int, rank: int, events: list[Any], ts: float) -> None:
        if not events:
            return
        payload = self.encoder.encode(wire.EventBatch(ts=ts, events=events, dp_rank=rank))
        batch = self.decoder.decode(payload)
        self.batches += 1
        name = self.names[instance]
        if self.router is not None:
            self.router.index.apply_batch(name, batch)
        if self.dp0 is not None and rank == 0:
            self.dp0.index.apply_batch(name, batch)
        if self.dispatchers:
            self.dispatchers[instance].observe(batch, rank)
        if self.adapter is not None:
            self.adapter_affinity().index.apply_batch(self.stream(instance), batch)

    def close(self) -> None:
        for affinity in (self.router, self.dp0):
            if affinity is not None:
                affinity.close()
        if self.adapter is not None:
            self.adapter.close()


# ------------------------------------------------------------------------------------------ cluster
@dataclass
class Rank:
    cache: RankCache
    queue: deque[tuple[Request, int]] = field(default_factory=deque)  # (request, uncached tokens at enqueue)
    busy: bool = False
    queued_tokens: int = 0  # uncached tokens of requests waiting (not yet started), as matched at enqueue
    run_finish: float = 0.0  # finish time of the running (or last) prefill
    pending: dict[int, int] = field(default_factory=dict)  # page key -> unfinished requests carrying it (oracle)
    free_at: float = 0.0  # projected time the queue is empty, from oracle-knowledge matches (oracle)


@dataclass
class Stats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    per_rank: list[int] = field(default_factory=list)
    evicted_pages: int = 0


class Cluster:
    """P x R ranks with caches and FIFO queues; a policy picks the rank of each arrival."""

    def __init__(self, instances: int, ranks: int, capacity_pages: int, page_size: int, tokens_per_s: float) -> None:
        self.n_inst = instances
        self.n_ranks = ranks
        self.page_size = page_size
        self.tokens_per_s = tokens_per_s
        self.ranks = [Rank(RankCache(capacity_pages, page_size)) for _ in range(instances * ranks)]
        self.events: list[tuple[float, int, int, Request]] = []  # (finish time, seq, flat rank, request)
        self._seq = 0
        self.now = 0.0
        self.stats = Stats(per_rank=[0] * (instances * ranks))
        self.track_pending = False  # oracle bookkeeping, off for the other policies (it costs time)
        self.feed: ShippedFeed | None = None  # the shipped router/dispatcher, fed each rank's events
        # Motor 3.1's own load book per prefill instance (see motor_commit): the load Motor's cost reads
        self.motor_book = [0.0] * instances
        self._motor_held: dict[int, tuple[int, float]] = {}  # id(request) -> (instance, committed tokens)

    # ----- what routers may observe
    def matched_tokens(self, flat: int, req: Request) -> int:
        """Published-cache hit of `req` on a rank, in tokens, capped at isl (Motor's matched)."""
        return min(self.ranks[flat].cache.match(req.keys) * self.page_size, req.isl)

    def rank_load(self, flat: int) -> float:
        """Prefill tokens still to compute on the rank, as the engine reports it: waiting requests' uncached
        tokens plus the remainder of the running prefill."""
        rank = self.ranks[flat]
        running = rank.run_finish - self.now
        return rank.queued_tokens + (running * self.tokens_per_s if running > 0 else 0.0)

    def instance_load(self, inst: int) -> float:
        base = inst * self.n_ranks
        return sum(self.rank_load(f) for f in range(base, base + self.n_ranks))

    def motor_load(self, inst: int) -> float:
        """Motor 3.1's workload score of the instance's endpoint: its book's active tokens."""
        return self.motor_book[inst]

    def motor_commit(self, req: Request, inst: int, matched: int) -> None:
        """Motor 3.1's ALLOCATE after an affinity pick: ``isl - matched`` (matched: the answer's
        figure for the picked endpoint, capped at isl) onto the endpoint's book, held until the
        request's prefill leg returns (released in _finish)."""
        committed = float(req.isl - min(max(matched, 0), req.isl))
        self.motor_book[inst] += committed
        self._motor_held[id(req)] = (inst, committed)

    def future_matched_tokens(self, flat: int, req: Request) -> int:
        """Oracle knowledge: the hit when `req` would start on this rank - cached pages plus the pages of every
        request queued or running there (they are inserted before it starts; evictions in between ignored)."""
        rank = self.ranks[flat]
        cache, pend = rank.cache, rank.pending
        n = 0
        for key in req.keys:
            if key not in cache and key not in pend:
                break
            n += 1
        return min(n * self.page_size, req.isl)

    def oracle_wait_s(self, flat: int) -> float:
        """Oracle knowledge: how long a request dispatched now would wait on the rank."""
        return max(0.0, self.ranks[flat].free_at - self.now)

    # ----- simulation
    def advance(self, t: float) -> None:
        """Process every prefill that finishes at or before t, then set the clock to t."""
        events = self.events
        while events and events[0][0] <= t:
            finish, _, flat, req = heapq.heappop(events)
            self.now = finish
            self._finish(flat, req)
        self.now = t

    def dispatch(self, req: Request, flat: int) -> None:
        rank = self.ranks[flat]
        uncached = req.isl - self.matched_tokens(flat, req)
        if self.track_pending:
            true_uncached = req.isl - self.future_matched_tokens(flat, req)
            rank.free_at = max(rank.free_at, self.now) + true_uncached / self.tokens_per_s
            pend = rank.pending
            for key in req.keys:
                pend[key] = pend.get(key, 0) + 1
        rank.queue.append((req, uncached))
        rank.queued_tokens += uncached
        self.stats.per_rank[flat] += 1
        if not rank.busy:
            self._start(flat, self.now)

    def drain(self) -> None:
        self.advance(float("inf"))

    def _start(self, flat: int, t: float) -> None:
        rank = self.ranks[flat]
        req, enqueued = rank.queue[0]
        rank.queued_tokens -= enqueued
        rank.busy = True
        cached = min(rank.cache.match(req.keys, touch=True) * self.page_size, req.isl)
        finish = t + (req.isl - cached) / self.tokens_per_s
        rank.run_finish = finish
        st = self.stats
        st.prompt_tokens += req.isl
        st.cached_tokens += cached
        st.ttfts.append(finish - req.arrival_s)
        self._seq += 1
        heapq.heappush(self.events, (finish, self._seq, flat, req))

    def _finish(self, flat: int, req: Request) -> None:
        rank = self.ranks[flat]
        rank.queue.popleft()
        held = self._motor_held.pop(id(req), None)
        if held is not None:  # the prefill leg returned: Motor releases the request's tokens
            inst, committed = held
            self.motor_book[inst] = max(0.0, self.motor_book[inst] - committed)
        res = rank.cache.insert(req.keys)  # the engine publishes BlockStored now
        self.stats.evicted_pages += len(res.evicted)
        if self.feed is not None:
            events = stored_events(req, res.stored, res.evicted, self.page_size)  # type: ignore[arg-type]
            self.feed.publish(flat // self.n_ranks, flat % self.n_ranks, events, self.now)
        if self.track_pending:
            pend = rank.pending
            for key in req.keys:
                left = pend[key] - 1
                if left:
                    pend[key] = left
                else:
                    del pend[key]
        rank.busy = False
        if rank.queue:
            self._start(flat, self.now)


# ------------------------------------------------------------------------------------------ policies
Policy = Callable[[Cluster, Request], int]  # -> flat rank index (instance * ranks + rank)


MotorPick = Callable[[dict[str, Any], list[tuple[str, float]], int, KvAffinityConfig], str]


def motor_ascend_pick(
    answer: dict[str, Any], candidates: list[tuple[str, float]], isl: int, cfg: KvAffinityConfig
) -> str:
    """The Ascend source's kv_cache_affinity, unchanged (a model of Motor's code, read from it:
    tests/fixtures/motor_versions.json): per listed instance ``matched = min(DP["0"], isl)``,
    ``prefill_load_scale * max(0, isl - overlap_credit * matched) + load_weight * load``, the
    lowest first (a stable sort: candidate order on ties)."""
    scored = []
    for name, load in candidates:
        entry = answer.get(name)
        if entry is None:
            continue
        matched = min(int(entry["DP"].get("0", 0)), isl)
        cost = cfg.prefill_load_scale * max(0.0, isl - cfg.overlap_credit * matched) + cfg.load_weight * load
        scored.append((cost, name))
    if not scored:  # nothing listed: load_balance
        return min(candidates, key=lambda c: c[1])[0]
    return min(scored, key=lambda s: s[0])[1]


def answer_matched(entry: dict[str, Any]) -> int:
    """The endpoint's matched tokens as Motor 3.1 reads them from the answer (an int or a dict)."""
    dp = entry.get("DP", {}).get("0", 0)
    return int(dp["matched_tokens"] if isinstance(dp, dict) else dp)


def motor_b2_pick(answer: dict[str, Any], candidates: list[tuple[str, float]], isl: int, cfg: KvAffinityConfig) -> str:
    """mindie-motor 3.0.0b2's kv_cache_affinity, unchanged (a model of its code): the last
    listed instance whose int ``GPU`` is not below the largest so far (starting at 0), then its
    endpoint by ``DP``; nothing selected: load_balance."""
    best_gpu, picked = 0, None
    for name, _ in candidates:
        entry = answer.get(name)
        if entry is None or entry.get("GPU", 0) < best_gpu:
            continue
        best_gpu, picked = entry.get("GPU", 0), name
    if picked is None or answer[picked].get("DP", {}).get("0", 0) < 0:
        return min(candidates, key=lambda c: c[1])[0]
    return picked


def unified_cost(isl: int, matched: int, load: float) -> float:
    """Motor's kv_cache_affinity unified score (lower wins)."""
    prefill_cost = max(0.0, isl - OVERLAP_CREDIT * matched)
    return PREFILL_LOAD_SCALE * prefill_cost + LOAD_WEIGHT * load


class Router:
    """Holds the round-robin counters and tie-break rotation of one run; `policy(name)` returns a Policy."""

    def __init__(
        self,
        instances: int,
        ranks: int,
        hotspot_tokens: float | None = None,
        seed: int = 0,
        feed: ShippedFeed | None = None,
    ) -> None:
        self.n_inst = instances
        self.n_ranks = ranks
        self.hotspot_tokens = hotspot_tokens
        self.feed = feed
        self._inst_rr = seed % instances
        self._rank_rr = [seed % ranks] * instances
        self._tick = seed  # rotates tie-breaks so equal scores do not always favour index 0

    def policy(self, name: str) -> Policy:
        table: dict[str, Policy] = {
            "default": self.default,
            "default_motor_b2": self.default_motor_b2,
            "round_robin": self.round_robin,
            "load_balance": self.load_balance,
            "dp0_only": self.dp0_only,
            "instance_affinity": self.instance_affinity,
            "fold_pinned": self.fold_pinned,
            "fold_pinned_dispatch": self.fold_pinned_dispatch,
            "model_dp0_only": self.model_dp0_only,
            "model_instance_affinity": self.model_instance_affinity,
            "model_fold_pinned": self.model_fold_pinned,
            "model_fold_pinned_dispatch": self.model_fold_pinned_dispatch,
            "oracle": self.oracle,
            "oracle_max_prefix": self.oracle_max_prefix,
        }
        if name not in table:
            raise ValueError(f"unknown policy {name!r}; choose from {', '.join(table)}")
        return table[name]

    # ----- helpers
    def _rr_rank(self, inst: int) -> int:
        """SGLang's round-robin DP dispatch inside an instance."""
        r = self._rank_rr[inst]
        self._rank_rr[inst] = (r + 1) % self.n_ranks
        return inst * self.n_ranks + r

    def _rotation(self, n: int) -> list[int]:
        self._tick += 1
        start = self._tick % n
        return [(start + i) % n for i in range(n)]

    def _best_instance(self, cl: Cluster, req: Request, matched_of: Callable[[int], int]) -> int:
        """Motor's unified cost per instance (instance load), lowest wins."""
        scored = [
            (unified_cost(req.isl, matched_of(inst), cl.instance_load(inst)), order, inst)
            for order, inst in enumerate(self._rotation(self.n_inst))
        ]
        return min(scored)[2]

    def _fold(self, cl: Cluster, req: Request, inst: int) -> int:
        """fold_engine_dps: the longest hit over the instance's ranks (never their union)."""
        base = inst * self.n_ranks
        return max(cl.matched_tokens(base + r, req) for r in range(self.n_ranks))

    def _best_rank(self, cl: Cluster, req: Request, flats: Sequence[int]) -> int:
        """Motor's unified cost per rank (rank load), lowest wins; optional hot-spot guard."""
        scored = []
        for order, flat in enumerate(flats):
            load = cl.rank_load(flat)
            scored.append((unified_cost(req.isl, cl.matched_tokens(flat, req), load), order, flat, load))
        if self.hotspot_tokens is not None:
            floor = min(s[3] for s in scored)
            scored = [s for s in scored if s[3] - floor <= self.hotspot_tokens]
        return min(scored)[2]

    # ----- the policies
    def round_robin(self, cl: Cluster, req: Request) -> int:
        inst = self._inst_rr
        self._inst_rr = (inst + 1) % self.n_inst
        return self._rr_rank(inst)

    def load_balance(self, cl: Cluster, req: Request) -> int:
        inst = min(self._rotation(self.n_inst), key=cl.instance_load)  # min keeps the first of equals
        return self._rr_rank(inst)

    # ----- the shipped code: motor_adapter's KvAffinity (Motor's kv_cache_affinity over the fold
    # of its PrefixIndex) and each instance's CacheAwareDispatcher, fed by the ranks' events
    def _select(self, cl: Cluster, req: Request, affinity: KvAffinity | None) -> tuple[int, int | None, Any]:
        """KvAffinity.select over every instance (Motor's load: its own book, motor_commit)
        -> (instance, pinned rank or None, the request's token ids)."""
        assert affinity is not None, "shipped policies need a ShippedFeed"
        feed = self.feed
        assert feed is not None
        tokens = request_tokens(req, cl.page_size)
        order = self._rotation(self.n_inst)  # candidate order: Motor keeps it on ties
        candidates = [Candidate(feed.names[i], cl.motor_load(i)) for i in order]
        decision = affinity.select(candidates, tokens)
        inst = feed.names.index(decision.instance_id)
        cl.motor_commit(req, inst, decision.matched or 0)
        return inst, decision.dp_rank, tokens

    def dp0_only(self, cl: Cluster, req: Request) -> int:
        """The report's bug, shipped code: the router's index sees only rank 0's stream."""
        inst, _, _ = self._select(cl, req, self.feed.dp0 if self.feed else None)
        return self._rr_rank(inst)

    def instance_affinity(self, cl: Cluster, req: Request) -> int:
        """The upstream fix: the instance by the fold, SGLang's round robin inside."""
        inst, _, _ = self._select(cl, req, self.feed.router if self.feed else None)
        return self._rr_rank(inst)

    def fold_pinned(self, cl: Cluster, req: Request) -> int:
        """Ours: the instance and the rank Motor's decision pins (``routed_dp_rank``)."""
        inst, rank, _ = self._select(cl, req, self.feed.router if self.feed else None)
        return inst * self.n_ranks + rank if rank is not None else self._rr_rank(inst)

    def fold_pinned_dispatch(self, cl: Cluster, req: Request) -> int:
        """The instance by the fold, the rank by the instance's cache-aware dispatcher."""
        inst, _, tokens = self._select(cl, req, self.feed.router if self.feed else None)
        assert self.feed is not None and self.feed.dispatchers
        base = inst * self.n_ranks
        loads = [cl.rank_load(base + r) for r in range(self.n_ranks)]
        rank = self.feed.dispatchers[inst].choose(tokens, loads).rank
        return base + rank if rank is not None else self._rr_rank(inst)

    def default(self, cl: Cluster, req: Request) -> int:
        """What operators get: Motor (the Ascend source's unchanged cost) over the adapter's
        ``/query`` answer picks the instance, the instance's dispatcher the rank."""
        return self._default(cl, req, motor_ascend_pick)

    def default_motor_b2(self, cl: Cluster, req: Request) -> int:
        """The same with mindie-motor 3.0.0b2's reading of the answer (the largest ``GPU``)."""
        return self._default(cl, req, motor_b2_pick)

    def _default(self, cl: Cluster, req: Request, motor: MotorPick) -> int:
        feed = self.feed
        assert feed is not None and feed.adapter is not None and feed.dispatchers
        tokens = request_tokens(req, cl.page_size)
        spread = spread_key(tokens, cl.page_size)
        keys = sequence_keys(tokens, cl.page_size)
        answer = feed.adapter.answer_keys(
            MODEL, TENANT, cl.page_size, keys, len(tokens) // cl.page_size, time.perf_counter(), len(tokens), spread
        ).body[TENANT]
        order = self._rotation(self.n_inst)  # Motor's instance order: it keeps it on ties
        candidates = [(f"vllm-prefill-{i}", cl.motor_load(i)) for i in order]
        picked = motor(answer, candidates, len(tokens), KvAffinityConfig(block_size=cl.page_size))
        inst = int(picked.rsplit("-", 1)[1])
        entry = answer.get(picked)
        cl.motor_commit(req, inst, answer_matched(entry) if entry is not None else 0)
        base = inst * self.n_ranks
        loads = [cl.rank_load(base + r) for r in range(self.n_ranks)]
        rank = feed.dispatchers[inst].choose(tokens, loads, spread=spread).rank
        if rank is not None:  # a prompt shorter than a block: Motor asks no /query, SGLang's policy runs
            feed.compared += 1
            feed.agreed += int(rank == answer[picked]["dp_detail"]["0"]["scored_rank"])
        return base + rank if rank is not None else self._rr_rank(inst)

    # ----- the earlier models of the same policies (baselines)
    def model_dp0_only(self, cl: Cluster, req: Request) -> int:
        return self._rr_rank(self._best_instance(cl, req, lambda i: cl.matched_tokens(i * self.n_ranks, req)))

    def model_instance_affinity(self, cl: Cluster, req: Request) -> int:
        return self._rr_rank(self._best_instance(cl, req, lambda i: self._fold(cl, req, i)))

    def model_fold_pinned(self, cl: Cluster, req: Request) -> int:
        return self._best_rank(cl, req, self._rotation(self.n_inst * self.n_ranks))

    def model_fold_pinned_dispatch(self, cl: Cluster, req: Request) -> int:
        inst = self._best_instance(cl, req, lambda i: self._fold(cl, req, i))
        return self._best_rank(cl, req, [inst * self.n_ranks + r for r in self._rotation(self.n_ranks)])

    def oracle(self, cl: Cluster, req: Request) -> int:
        """Perfect-knowledge greedy: the rank of least exact TTFT (exact future hit, exact wait)."""
        scored = []
        for order, flat in enumerate(self._rotation(self.n_inst * self.n_ranks)):
            wait_tokens = cl.oracle_wait_s(flat) * cl.tokens_per_s
            scored.append((unified_cost(req.isl, cl.future_matched_tokens(flat, req), wait_tokens), order, flat))
        return min(scored)[2]

    def oracle_max_prefix(self, cl: Cluster, req: Request) -> int:
        """Oracle knowledge, longest future hit first, ties by least wait (diagnostic: it hot-spots)."""
        scored = [
            (-cl.future_matched_tokens(flat, req), cl.oracle_wait_s(flat), order, flat)
            for order, flat in enumerate(self._rotation(self.n_inst * self.n_ranks))
        ]
        return min(scored)[3]


# ------------------------------------------------------------------------------------------ runner
@dataclass(frozen=True)
class SimConfig:
    instances: int = 2
    ranks: int = 16
    capacity_pages: int = DEFAULT_CAPACITY_PAGES
    page_size: int = PAGE_SIZE
    tokens_per_s: float = DEFAULT_TOKENS_PER_S
    hotspot_tokens: float | None = None
    seed: int = 0
    load_report_s: float = LOAD_REPORT_S


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, math.ceil(q / 100.0 * len(ordered)) - 1))
    return ordered[idx]


def simulate(policy_name: str, requests: Sequence[Request], cfg: SimConfig) -> dict[str, Any]:
    """Run one policy on a fresh cluster; returns the policy's figures (without trace metadata)."""
    cl = Cluster(cfg.instances, cfg.ranks, cfg.capacity_pages, cfg.page_size, cfg.tokens_per_s)
    cl.track_pending = policy_name.startswith("oracle")
    feed = None
    if policy_name in SHIPPED_POLICIES:
        feed = ShippedFeed(
            cfg.instances,
            cfg.ranks,
            cfg.page_size,
            router=policy_name != "dp0_only",
            dp0=policy_name == "dp0_only",
            dispatch=policy_name in ("fold_pinned_dispatch", *DEFAULT_POLICIES),
            adapter=policy_name in DEFAULT_POLICIES,
        )
    cl.feed = feed
    router = Router(cfg.instances, cfg.ranks, cfg.hotspot_tokens, cfg.seed, feed=feed)
    policy = router.policy(policy_name)
    t0 = time.perf_counter()
    period = cfg.load_report_s
    reported = -1.0
    try:
        for req in requests:
            if feed is not None and feed.adapter is not None:
                # The adapter's view at this arrival: the fan-in's last rank-load message, sent at
                # the last multiple of the period (each instance's ranks' queued prefill tokens then).
                at = math.floor(req.arrival_s / period) * period
                if at > reported:
                    cl.advance(at)
                    for inst in range(cfg.instances):
                        base = inst * cfg.ranks
                        feed.report_loads(inst, [cl.rank_load(base + r) for r in range(cfg.ranks)], at)
                    reported = at
            cl.advance(req.arrival_s)
            cl.dispatch(req, policy(cl, req))
        cl.drain()
    finally:
        if feed is not None:
            feed.close()
    wall = time.perf_counter() - t0
    st = cl.stats
    mean_per_rank = len(requests) / len(st.per_rank)
    return {
        "policy": policy_name,
        "hit_ratio": round(st.cached_tokens / st.prompt_tokens, 6) if st.prompt_tokens else 0.0,
        "prefill_tokens": st.prompt_tokens - st.cached_tokens,
        "ttft_p50_s": round(percentile(st.ttfts, 50), 4),
        "ttft_p90_s": round(percentile(st.ttfts, 90), 4),
        "ttft_p99_s": round(percentile(st.ttfts, 99), 4),
        "ttft_mean_s": round(sum(st.ttfts) / len(st.ttfts), 4) if st.ttfts else 0.0,
        "requests": len(requests),
        "prompt_tokens": st.prompt_tokens,
        "cached_tokens": st.cached_tokens,
        "evicted_pages": st.evicted_pages,
        "rank_requests_max_over_mean": round(max(st.per_rank) / mean_per_rank, 3) if requests else 0.0,
        "sim_wall_s": round(wall, 3),
        "code": "shipped" if feed is not None else ("oracle" if policy_name.startswith("oracle") else "model"),
        "wire_batches": feed.batches if feed is not None else 0,
        **(
            {"load_reports": feed.load_reports, "rank_agreement": round(feed.agreed / feed.compared, 4)}
            if feed is not None and feed.compared
            else {}
        ),
    }


def run(
    requests: Sequence[Request], cfg: SimConfig, policies: Sequence[str], extra: dict[str, Any]
) -> list[dict[str, Any]]:
    """Simulate every policy; add trace metadata, ratios to oracle and the issue-9 comparison."""
    results = [{"bench": "routing", **extra, **simulate(p, requests, cfg)} for p in policies]
    by_name = {r["policy"]: r for r in results}
    oracle = by_name.get("oracle")
    for r in results:
        if oracle and oracle["hit_ratio"] > 0:
            r["hit_ratio_vs_oracle"] = round(r["hit_ratio"] / oracle["hit_ratio"], 4)
    for name in DEFAULT_POLICIES:  # what the targets compare the default path with, in its own line
        r = by_name.get(name)
        if r is None:
            continue
        others = [o for o in results if o["code"] == "shipped" and o["policy"] not in DEFAULT_POLICIES]
        if others:
            best = max(others, key=lambda o: o["hit_ratio"])
            r["best_other_shipped"] = best["policy"]
            r["best_other_shipped_hit_ratio"] = best["hit_ratio"]
        if oracle:
            r["oracle_ttft_p50_s"] = oracle["ttft_p50_s"]
            r["oracle_ttft_p90_s"] = oracle["ttft_p90_s"]
    disp, rr_disp = by_name.get("fold_pinned_dispatch"), by_name.get("instance_affinity")
    if disp and rr_disp:
        disp["rr_dispatch_policy"] = "instance_affinity"
        disp["hit_ratio_vs_rr_dispatch"] = _ratio(disp["hit_ratio"], rr_disp["hit_ratio"])
        disp["ttft_p50_vs_rr_dispatch"] = _ratio(disp["ttft_p50_s"], rr_disp["ttft_p50_s"])
        disp["ttft_p90_vs_rr_dispatch"] = _ratio(disp["ttft_p90_s"], rr_disp["ttft_p90_s"])
    return results


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def plot(results: Sequence[dict[str, Any]], title: str, path: Path) -> str | None:
    """Bar charts of hit ratio and TTFT p50/p90 per policy. Returns a note instead when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: plot skipped"
    names = [r["policy"] for r in results]
    xs = list(range(len(names)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = [
        "tab:green" if r["policy"] in DEFAULT_POLICIES else "tab:gray" if r.get("code") == "oracle" else "tab:blue"
        for r in results
    ]
    ax1.bar(xs, [r["hit_ratio"] for r in results], color=colors)
    ax1.set_title("prefix-cache hit ratio (cached / prompt tokens); green: the default path")
    top = max([r["hit_ratio"] for r in results] + [results[0].get("hit_ceiling") or 0.0])
    ax1.set_ylim(0, max(0.05, top * 1.15))
    for x, r in zip(xs, results, strict=True):
        ax1.text(x, r["hit_ratio"], f"{r['hit_ratio']:.3f}", ha="center", va="bottom", fontsize=8)
    ceiling = results[0].get("hit_ceiling")
    if ceiling:
        ax1.axhline(ceiling, color="gray", linestyle="--", linewidth=1)
        ax1.text(xs[-1], ceiling, f"ceiling {ceiling:.3f}", ha="right", va="bottom", fontsize=8, color="gray")
    width = 0.4
    ax2.bar([x - width / 2 for x in xs], [r["ttft_p50_s"] for r in results], width, label="p50")
    ax2.bar([x + width / 2 for x in xs], [r["ttft_p90_s"] for r in results], width, label="p90")
    ax2.set_title("TTFT (s) = queue wait + prefill")
    ax2.set_yscale("log")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.set_xticks(xs)
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake jsonl trace (default: %(default)s)")
    p.add_argument(
        "--workload",
        choices=("trace", "agentic", ROLLOUT),
        default="trace",
        help="trace: the --trace file; agentic: sessions generated from --seed (agentic_records); "
        "rollout: RL rollout bursts generated from --seed (rollout_records)",
    )
    p.add_argument("--sessions", type=int, default=1200, help="agentic sessions (default %(default)s)")
    p.add_argument("--instances", type=int, default=2, help="prefill instances (default 2)")
    p.add_argument("--ranks", type=int, default=16, help="DP ranks per instance (default 16)")
    p.add_argument(
        "--capacity-pages", type=int, default=DEFAULT_CAPACITY_PAGES, help="KV pages per rank (default %(default)s)"
    )
    p.add_argument("--page-size", type=int, default=PAGE_SIZE, help="tokens per page, divides 512 (default 128)")
    p.add_argument("--load", type=float, default=0.6, help="cold offered load / prefill capacity (default 0.6)")
    p.add_argument(
        "--tokens-per-s", type=float, default=DEFAULT_TOKENS_PER_S, help="prefill tokens/s per rank (default 714)"
    )
    p.add_argument("--limit", type=int, default=None, help="use only the first N requests")
    p.add_argument("--policies", default=",".join(ALL_POLICIES), help="comma-separated (default: all)")
    p.add_argument("--hotspot-tokens", type=float, default=None, help="fold_pinned hot-spot guard (default off)")
    p.add_argument("--seed", type=int, default=0, help="seed of the tie-break rotation start (default 0)")
    p.add_argument("--out-dir", type=Path, default=_HERE / "results", help="where the PNG goes")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = p.parse_args(argv)
    if args.instances < 1 or args.ranks < 1 or args.capacity_pages < 1:
        p.error("--instances, --ranks and --capacity-pages must be >= 1")
    if args.load <= 0 or args.tokens_per_s <= 0:
        p.error("--load and --tokens-per-s must be > 0")
    if args.page_size < 1 or TRACE_BLOCK_TOKENS % args.page_size:
        p.error("--page-size must divide 512")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in ALL_POLICIES + EXTRA_POLICIES]
    if unknown:
        known = ", ".join(ALL_POLICIES + EXTRA_POLICIES)
        print(f"error: unknown policies {unknown}; choose from {known}", file=sys.stderr)
        return 2
    if args.workload == "agentic":
        records = agentic_records(args.seed, args.sessions)[: args.limit]
        name = AGENTIC
    elif args.workload == ROLLOUT:
        records = rollout_records(args.seed)[: args.limit]
        name = ROLLOUT
    else:
        try:
            records = load_trace(args.trace, args.limit)
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        name = args.trace.name
    cfg = SimConfig(
        instances=args.instances,
        ranks=args.ranks,
        capacity_pages=args.capacity_pages,
        page_size=args.page_size,
        tokens_per_s=args.tokens_per_s,
        hotspot_tokens=args.hotspot_tokens,
        seed=args.seed,
    )
    capacity = cfg.instances * cfg.ranks * cfg.tokens_per_s
    requests, scale = build_requests(records, capacity, args.load, cfg.page_size)
    extra = {
        "trace": name,
        "instances": cfg.instances,
        "ranks": cfg.ranks,
        "capacity_pages": cfg.capacity_pages,
        "page_size": cfg.page_size,
        "load": args.load,
        "tokens_per_s_per_rank": round(cfg.tokens_per_s, 2),
        "time_scale": round(scale, 4),
        "hit_ceiling": round(hit_ceiling(requests, cfg.page_size), 6),
    }
    results = run(requests, cfg, policies, extra)
    stem = name.removesuffix(".jsonl")
    for r in results:
        print(json.dumps(with_targets(r)), flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"routing_{stem}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    if not args.no_plot:
        title = (
            f"{name}: {len(requests)} requests, {cfg.instances}x{cfg.ranks} ranks, "
            f"{cfg.capacity_pages} pages/rank, load {args.load}"
        )
        note = plot(results, title, args.out_dir / f"routing_{stem}.png")
        print(note or f"plot: {args.out_dir / f'routing_{stem}.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
