"""``sglang-kvpub check-config``: the plugin's settings and guarantees before a launch.

Checks ``--kv-events-config`` (plus ``SGLANG_KVPUB_*``) exactly as ``--plugin sglang_kvpub``
does at start, then reports the radix tree core SGLang will pick for ``--device`` (from
``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND``) and what the plugin guarantees on it: fan-in,
``BlockRemoved`` on release, reconciliation and dispatch (docs/hbm-release.md, "Tree
cores"), and whether cache-aware DP dispatch is on for ``--disaggregation-mode`` and
``--load-balance-method`` (off for an explicit ``follow_bootstrap_room``; docs/dispatch.md).
With ``--adapter-config`` it also compares the dispatcher's rank cost (the plugin's cost keys)
with the Motor adapter's ``kv_affinity``: they must be equal (docs/dispatch.md).
Exit 0: valid (limits are reported, not errors); 1: the cost differs from the adapter's;
2: a configuration error.
Needs neither SGLang nor torch.
"""

from __future__ import annotations

import argparse
import json

from sglang_kvpub.config import ConfigError
from sglang_kvpub.core import cost_settings
from sglang_kvpub.core.load_balance import plan_dispatch
from sglang_kvpub.engine import tree_cores

__all__ = ["add_parser", "run", "report"]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "check-config",
        help="check --kv-events-config and report the tree core's guarantees",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--kv-events-config", required=True, help="the JSON given to SGLang's --kv-events-config")
    parser.add_argument("--device", default="cuda", help="SGLang's --device (cpu, cuda, npu; default cuda)")
    parser.add_argument("--dp-size", type=int, default=1, help="DP ranks (dp_size x attn_dp_size)")
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument(
        "--disaggregation-mode", default="null", help="SGLang's --disaggregation-mode (null, prefill, decode)"
    )
    parser.add_argument("--load-balance-method", default="auto", help="SGLang's --load-balance-method (default auto)")
    parser.add_argument(
        "--adapter-config",
        default=None,
        help="the Motor adapter's serve --config JSON: its kv_affinity cost must equal the plugin's cost keys",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(run=run)


def report(
    kv_events_config: str,
    *,
    device: str,
    dp_size: int = 1,
    nnodes: int = 1,
    disaggregation_mode: str = "null",
    load_balance_method: str = "auto",
    adapter_config: str | None = None,
) -> dict[str, object]:
    """The validated settings, whether dispatch is on (core/load_balance.py) and the tree
    core's guarantees; raises ConfigError."""
    from sglang_kvpub.engine.plugin import validate_launch

    config = validate_launch(kv_events_config, num_dp_ranks=dp_size, nnodes=nnodes, version=(0, 5, 23))
    core = tree_cores.predict_core(device)
    plan = plan_dispatch(
        dp_dispatch=config.dp_dispatch,
        requested_method=load_balance_method,
        disaggregation_mode=disaggregation_mode,
        num_dp_ranks=dp_size,
    )
    result: dict[str, object] = {
        "valid": True,
        "endpoint": config.endpoint,
        "replay_endpoint": config.replay_endpoint,
        "dp_dispatch": config.dp_dispatch,
        "dispatch": plan.as_dict(),
        "tree_core": tree_cores.describe(core),
        "cost": config.cost(),
    }
    if adapter_config is not None:
        result["cost_mismatches"] = _cost_mismatches(kv_events_config, adapter_config)
    return result


def _cost_mismatches(kv_events_config: str, adapter_config: str) -> list[str]:
    """The cost keys on which the plugin (this JSON plus SGLANG_KVPUB_*) and the adapter differ."""
    import os

    data = json.loads(kv_events_config) if kv_events_config.strip() else {}
    engine, where = cost_settings.engine_cost(data, os.environ)
    fix = "pass the JSON given to motor-kv-adapter serve --config"
    try:
        with open(adapter_config, encoding="utf-8") as handle:
            raw = json.load(handle)
        adapter = cost_settings.adapter_cost_from_json(raw) if isinstance(raw, dict) else None
    except (OSError, ValueError) as exc:
        return [str(cost_settings.Mismatch("--adapter-config", f"{adapter_config}: cannot be read: {exc}", fix))]
    if adapter is None:
        why = f"{adapter_config} takes its weights from motor_config, not a kv_affinity object"
        fix = "compare with motor-kv-adapter check-config USER_CONFIG --env-config ENV --adapter-config THIS_FILE"
        return [str(cost_settings.Mismatch("--adapter-config", why, fix))]
    return [str(m) for m in cost_settings.compare(engine, where, adapter, adapter_config)]


def run(args: argparse.Namespace) -> int:
    try:
        result = report(
            args.kv_events_config,
            device=args.device,
            dp_size=args.dp_size,
            nnodes=args.nnodes,
            disaggregation_mode=args.disaggregation_mode,
            load_balance_method=args.load_balance_method,
            adapter_config=args.adapter_config,
        )
    except ConfigError as exc:
        print(f"invalid: {exc}")
        return 2
    mismatches = result.get("cost_mismatches") or []
    assert isinstance(mismatches, list)
    if args.json:
        print(json.dumps(result, indent=1))
        return 1 if mismatches else 0
    core = result["tree_core"]
    assert isinstance(core, dict)
    print(f"valid: instance PUB {result['endpoint']}, replay {result['replay_endpoint']}")
    dispatch = result["dispatch"]
    assert isinstance(dispatch, dict)
    state = "on" if dispatch["on"] else "off"
    print(
        f"dp_dispatch: {result['dp_dispatch']}: cache-aware DP dispatch {state} "
        f"(--load-balance-method {dispatch['load_balance_method']}): {dispatch['reason']}"
    )
    print(f"tree core: {core['core']} (--device {args.device}, {tree_cores.BACKEND_ENV})")
    for name, what in core.get("features", {}).items():
        print(f"  {name}: {what}")
    line = tree_cores.limit_line(core["core"], f"--device {args.device}")
    if line is not None:
        print(line)
    cost = result["cost"]
    assert isinstance(cost, dict)
    print("rank cost: " + " ".join(f"{k}={v}" for k, v in cost.items()))
    for mismatch in mismatches:
        print(mismatch)
    if mismatches:
        print(f"the dispatcher's cost differs from the adapter's ({args.adapter_config}): {len(mismatches)} key(s)")
        return 1
    if args.adapter_config is not None:
        print(f"rank cost: the same as the adapter's ({args.adapter_config})")
    return 0
