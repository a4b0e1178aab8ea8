"""``sglang-kvpub check-config``: the plugin's settings and guarantees before a launch.

Checks ``--kv-events-config`` (plus ``SGLANG_KVPUB_*``) exactly as ``--plugin sglang_kvpub``
does at start, then reports the radix tree core SGLang will pick for ``--device`` (from
``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND``) and what the plugin guarantees on it: fan-in,
``BlockRemoved`` on release, reconciliation and dispatch (docs/hbm-release.md, "Tree
cores"), and whether cache-aware DP dispatch is on for ``--disaggregation-mode`` and
``--load-balance-method`` (off for an explicit ``follow_bootstrap_room``; docs/dispatch.md).
Exit 0: valid (limits are reported, not errors); 2: a configuration error.
Needs neither SGLang nor torch.
"""

from __future__ import annotations

import argparse
import json

from sglang_kvpub.config import ConfigError
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
    return {
        "valid": True,
        "endpoint": config.endpoint,
        "replay_endpoint": config.replay_endpoint,
        "dp_dispatch": config.dp_dispatch,
        "dispatch": plan.as_dict(),
        "tree_core": tree_cores.describe(core),
    }


def run(args: argparse.Namespace) -> int:
    try:
        result = report(
            args.kv_events_config,
            device=args.device,
            dp_size=args.dp_size,
            nnodes=args.nnodes,
            disaggregation_mode=args.disaggregation_mode,
            load_balance_method=args.load_balance_method,
        )
    except ConfigError as exc:
        print(f"invalid: {exc}")
        return 2
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
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
    return 0
