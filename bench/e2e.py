"""The originating report's headline, measured: a repeated long prefix through Motor, hot vs cold.

Motor's real coordinator -> ``motor-kv-adapter serve`` -> one real SGLang CPU server
(``--dp-size 2 --plugin sglang_kvpub``), the rig of the end-to-end test tier
(bench/e2e_rig.py), on a dummy-weight Llama sized so that prefill dominates on this CPU
(``--layers``/``--hidden``: seconds for a few thousand tokens).

Why wide and shallow (2 x 2048 by default): SGLang's CPU attention backend (torch_native)
computes a cached request's attention over its whole sequence (its extend path fills a
full-length query), so on CPU a hit saves the projections and the MLP, not the attention;
accelerator kernels skip both.  A wide model makes the part a hit saves dominate, as it
does on an accelerator; a narrow one would measure the CPU backend's attention instead.

Two rigs in one run, one after the other (Motor's coordinator is one per machine), same
prompts, same model:

- ``cache_aware``: the plugin's default in-instance dispatch;
- ``round_robin``: the plugin with ``dp_dispatch: "default"`` (SGLang's own round robin,
  the report's state once Motor scores the instance: it cannot pick the rank).

Each of ``--prompts`` long prompts is sent cold once, then ``--repeats`` times, one request
at a time through Motor's ``/v1/completions``.  Per rig, one JSON line: Motor's scores
(``kv_cache_affinity`` hit on every repeat), the repeats SGLang served from cache
(``repeats_cached_fraction``: target 1.0 with cache-aware dispatch, about 1/dp_size with
round robin), and ``hot_over_cold`` = median repeat time / median cold time (target <= 0.3;
the report saw ~9 s -> ~2 s).  Times are whole requests as a client sees them through Motor.

``--pd``: the report's shape (bench/pd_rig.py): Motor's ``pd_dual_dispatch`` in front of two
PD prefill instances (``--dp-size 2``, the plugin) and one decode, KV over Mooncake's transfer
engine on TCP.  Two rigs, one after the other: ``cache_aware`` (the plugin's dispatch; it
makes the prefill's ``auto`` method ``round_robin`` and the decode asks the bootstrap server
for the rank) and ``sglang_pd_default`` (``dp_dispatch: "default"``: the prefill keeps
SGLang's ``follow_bootstrap_room``, rank = Motor's random room % dp_size).  One ``e2e_pd``
line each: Motor's scores, the repeats served from the holding rank's cache
(``repeats_cached_fraction``, target 1.0) and ``hot_over_cold`` (target <= 0.3); a hot
request still ships its whole KV to the decode, over TCP here.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import e2e_rig
import sglang_server
from _common import emit, percentile, with_targets

POLICIES = {"cache_aware": "cache_aware", "round_robin": "default"}  # bench label -> plugin dp_dispatch
# --pd: the plugin's dispatch (SGLang's auto made round_robin) vs SGLang's PD default
# (dp_dispatch "default": the prefill keeps follow_bootstrap_room, rank = Motor's random room % dp).
PD_POLICIES = {"cache_aware": "cache_aware", "sglang_pd_default": "default"}


def _rig_line(label: str, args: argparse.Namespace, work: Path, model: Path, prompts: Sequence[str]) -> dict[str, Any]:
    spec = e2e_rig.RigSpec(
        work_dir=work / label,
        model_dir=model,
        dispatch=POLICIES[label],
        tree_core=args.tree_core,
        page_size=args.page_size,
        max_total_tokens=args.max_total_tokens,
    )
    cold_s: list[float] = []
    hot_s: list[float] = []
    cached: list[int] = []
    expected: list[int] = []
    scored: list[int] = []
    errors = 0
    with e2e_rig.Rig(spec) as rig:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model))
        ready_s = rig.timings.get("ready_s", 0.0)
        for rank_warmup in range(spec.dp_size):  # first long forward of each rank, not measured
            rig.complete(e2e_rig.prompt_text(900 + rank_warmup, args.prompt_words), max_tokens=args.max_tokens)
        prompt_tokens = 0
        for prompt in prompts:
            ids = tokenizer(prompt)["input_ids"]
            prompt_tokens = prompt_tokens or len(ids)
            full = len(ids) // args.page_size * args.page_size
            cold = rig.complete(prompt, max_tokens=args.max_tokens)
            errors += cold.status != 200
            cold_s.append(cold.seconds)
            rig.wait_for_hit(ids)  # Motor scores what the adapter holds: let request 1's blocks arrive
            for _ in range(args.repeats):
                hot = rig.complete(prompt, max_tokens=args.max_tokens)
                errors += hot.status != 200
                hot_s.append(hot.seconds)
                cached.append(hot.cached_tokens)
                expected.append(full)
                scored.append(hot.scores[-1].matched if hot.scores else 0)
                time.sleep(args.gap_s)  # a think time between a user's turns, not synchronisation
    repeats = len(cached)
    served_from_cache = sum(1 for got, full in zip(cached, expected, strict=True) if got >= full > 0)
    return {
        "bench": "e2e",
        "dispatch": label,
        "dp_size": 2,
        "tree_core": args.tree_core,
        "model": f"llama dummy {args.layers}x{args.hidden}",
        "prompt_tokens": prompt_tokens,
        "page_size": args.page_size,
        "prompts": len(prompts),
        "repeats": repeats,
        "motor_scored_hit_fraction": round(sum(1 for s in scored if s > 0) / repeats, 3),
        "repeats_cached_fraction": round(served_from_cache / repeats, 3),
        "cached_tokens_per_repeat": round(sum(cached) / repeats, 1),
        **_timings(cold_s, hot_s, errors, ready_s),
    }


def _timings(cold_s: Sequence[float], hot_s: Sequence[float], errors: int, ready_s: float) -> dict[str, Any]:
    """The time fields both lines share: cold and hot medians, hot p90, their ratio, the samples."""
    cold_med, hot_med = statistics.median(cold_s), statistics.median(hot_s)
    return {
        "cold_s_median": round(cold_med, 3),
        "hot_s_median": round(hot_med, 3),
        "hot_s_p90": round(percentile(hot_s, 90), 3),
        "hot_over_cold": round(hot_med / cold_med, 3) if cold_med else None,
        "cold_s": [round(v, 3) for v in cold_s],
        "hot_s": [round(v, 3) for v in hot_s],
        "errors": errors,
        "rig_ready_s": round(ready_s, 1),
    }


def _pd_rig_line(
    label: str, args: argparse.Namespace, work: Path, model: Path, prompts: Sequence[str]
) -> dict[str, Any]:
    """The report's shape: Motor's pd_dual_dispatch -> 2 prefills x dp 2 + 1 decode (bench/pd_rig.py)."""
    import pd_rig

    spec = pd_rig.PdRigSpec(
        work_dir=work / f"pd-{label}",
        model_dir=model,
        dispatch=PD_POLICIES[label],
        tree_core=args.tree_core,
        page_size=args.page_size,
        max_total_tokens=args.max_total_tokens,
        decode_max_total_tokens=args.max_total_tokens,
    )
    cold_s: list[float] = []
    hot_s: list[float] = []
    served_from_cache = scored_hits = repeats = errors = 0
    on_holder = 0
    with pd_rig.PdRig(spec) as rig:
        ready_s = rig.timings.get("ready_s", 0.0)
        for warmup in range(spec.dp_size):  # first long forward of the ranks Motor's tie-break picks
            rig.complete(e2e_rig.prompt_text(900 + warmup, args.prompt_words), max_tokens=args.max_tokens)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model))
        prompt_tokens = 0
        for prompt in prompts:
            ids = tokenizer(prompt)["input_ids"]
            prompt_tokens = prompt_tokens or len(ids)
            full = len(ids) // args.page_size * args.page_size
            cold = rig.complete(prompt, max_tokens=args.max_tokens)
            errors += cold.status != 200 or cold.completion_tokens == 0
            cold_s.append(cold.seconds)
            holder = cold.served
            rig.wait_for(
                lambda ids=ids, holder=holder: holder is not None and rig.held_on(ids, *holder),
                "the adapter's hit on the cold prompt, on its rank",
            )
            for _ in range(args.repeats):
                hot = rig.complete(prompt, max_tokens=args.max_tokens)
                errors += hot.status != 200 or hot.completion_tokens == 0
                hot_s.append(hot.seconds)
                repeats += 1
                served_from_cache += hot.cached_tokens >= full > 0
                scored_hits += bool(hot.scores and hot.scores[-1].matched > 0)
                on_holder += hot.served == holder
                time.sleep(args.gap_s)  # a think time between a user's turns, not synchronisation
    return {
        "bench": "e2e_pd",
        "dispatch": label,
        "prefill_load_balance_method": "round_robin (auto, switched by the plugin)"
        if label == "cache_aware"
        else "follow_bootstrap_room (SGLang's PD default)",
        "topology": f"{len(pd_rig.PREFILL_HOSTS)} prefill x dp {spec.dp_size} + 1 decode, Motor pd_dual_dispatch",
        "transfer": "mooncake_tcp",
        "tree_core": args.tree_core,
        "model": f"llama dummy {args.layers}x{args.hidden}, {args.kv_heads or 1} kv heads of 4",
        "prompt_tokens": prompt_tokens,
        "page_size": args.page_size,
        "prompts": len(prompts),
        "repeats": repeats,
        "motor_scored_hit_fraction": round(scored_hits / repeats, 3),
        "repeats_on_holding_rank_fraction": round(on_holder / repeats, 3),
        "repeats_cached_fraction": round(served_from_cache / repeats, 3),
        **_timings(cold_s, hot_s, errors, ready_s),
    }


def _stop(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=3, help="distinct long prompts")
    parser.add_argument("--repeats", type=int, default=2, help="repeats of each prompt after its cold request")
    parser.add_argument("--prompt-words", type=int, default=600, help="pseudo-words per prompt (~5 tokens each)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    parser.add_argument("--gap-s", type=float, default=0.5)
    parser.add_argument("--tree-core", default="rust", choices=("rust", "python"))
    parser.add_argument(
        "--dispatch", default="both", choices=("cache_aware", "round_robin", "sglang_pd_default", "both")
    )
    parser.add_argument("--quick", action="store_true", help="a small model and 2 prompts (a smoke run)")
    parser.add_argument(
        "--pd",
        action="store_true",
        help="the report's PD shape (bench/pd_rig.py: Motor pd_dual_dispatch, 2 prefills x dp 2 + 1 decode, "
        "Mooncake TCP): the plugin's dispatch vs SGLang's PD default (follow_bootstrap_room)",
    )
    parser.add_argument(
        "--kv-heads",
        type=int,
        default=0,
        help="key/value heads of the 4 attention heads (default 4; --pd: 1, grouped-query attention: a hot PD "
        "request still ships its whole KV to the decode, and the report's models move a small KV per token)",
    )
    parser.add_argument("--work-dir", default=None, help="keep the processes' logs here (default: a temporary dir)")
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.prompts, args.repeats = 256, 2, 1
    missing = e2e_rig.environment_ready()
    if missing:
        emit({"bench": "e2e", "skipped": f"needs {', '.join(missing)} (.ci/requirements-*.txt)"})
        return 0
    signal.signal(signal.SIGTERM, _stop)  # a stopped bench tears its servers down (context managers)
    policies = PD_POLICIES if args.pd else POLICIES
    labels = list(policies) if args.dispatch == "both" else [args.dispatch]
    rig_line = _pd_rig_line if args.pd else _rig_line
    prompts = [e2e_rig.prompt_text(1000 + n, args.prompt_words) for n in range(args.prompts)]
    with tempfile.TemporaryDirectory(prefix="kvpub-bench-e2e-") as tmp:
        work = Path(args.work_dir) if args.work_dir else Path(tmp)
        kv_heads = args.kv_heads or (1 if args.pd else 4)
        model = sglang_server.make_model_dir(work / "model", layers=args.layers, hidden=args.hidden, kv_heads=kv_heads)
        for label in labels:
            emit(with_targets(rig_line(label, args, work, model, prompts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
