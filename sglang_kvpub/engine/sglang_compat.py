"""What the plugin needs to know about the installed SGLang, looked up lazily.

Nothing here imports SGLang at module level: the functions import it when called, which
only happens inside SGLang processes (or tests that load SGLang on purpose).  Version
facts (from the released wheels, see docs/plugin.md):

- 0.5.11: the general plugin system (entry point group ``sglang.srt.plugins``,
  ``HookRegistry``) appears; schedulers load plugins.
- 0.5.22: the DataParallelController process loads plugins too, so the fan-in can live
  there.  Older versions need the sidecar (``sglang-kvpub fanin``) when dp > 1.
- 0.5.23: the version this plugin is tested against (runtime context accessors
  ``get_parallel`` / ``get_server_args``, ``kv_event_block_size_of``).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import re
from typing import Any

__all__ = [
    "MIN_PLUGIN_VERSION",
    "MIN_DP_CONTROLLER_VERSION",
    "TESTED_VERSION",
    "TARGET_ADD_CLI_ARGS",
    "TARGET_FROM_CLI_ARGS",
    "TARGET_FACTORY_CREATE",
    "TARGET_DP_CONTROLLER_INIT",
    "TARGET_DESCRIBE",
    "TARGET_CHECK_SERVER_ARGS",
    "IncompatibleSGLang",
    "Topology",
    "parse_version",
    "sglang_version",
    "version_text",
    "check_supported",
    "hook_api",
    "kv_events_module",
    "raw_num_dp_ranks",
    "scheduler_topology",
    "controller_topology",
    "LoadBalanceInputs",
    "load_balance_inputs",
    "declare_load_balance_method",
]

MIN_PLUGIN_VERSION = (0, 5, 11)
MIN_DP_CONTROLLER_VERSION = (0, 5, 22)
TESTED_VERSION = (0, 5, 23)

# HookRegistry targets (dotted paths, resolved by SGLang's pkgutil.resolve_name).
TARGET_ADD_CLI_ARGS = "sglang.srt.server_args.ServerArgs.add_cli_args"
TARGET_FROM_CLI_ARGS = "sglang.srt.server_args.ServerArgs.from_cli_args"
TARGET_FACTORY_CREATE = "sglang.srt.disaggregation.kv_events.EventPublisherFactory.create"
TARGET_DP_CONTROLLER_INIT = "sglang.srt.managers.data_parallel_controller.DataParallelController.__init__"
TARGET_DESCRIBE = "sglang.srt.runtime_context.describe_kv_events_publisher"
# Called by Engine._launch_subprocesses after resolve_once() and load_plugins(), before the
# config is published to any process: the one place every launch path passes through.
TARGET_CHECK_SERVER_ARGS = "sglang.srt.server_args.ServerArgs.check_server_args"

SIDECAR_HINT = (
    "fallback: start SGLang without --plugin and run the sidecar "
    "`sglang-kvpub fanin --rank-base tcp://127.0.0.1:<kv port> --dp-size <N> --endpoint tcp://*:<port>`"
)


class IncompatibleSGLang(RuntimeError):
    """The installed SGLang cannot run the plugin in this configuration; says the fallback."""


@dataclasses.dataclass(frozen=True)
class Topology:
    """What a process needs to place itself: ranks, who runs the fan-in, block size."""

    num_dp_ranks: int
    uses_dp_controller: bool
    block_size: int
    node_rank: int = 0
    is_scale_joiner: bool = False


def parse_version(text: str) -> tuple[int, ...]:
    """``"0.5.23"`` -> ``(0, 5, 23)``; ``"0.5.10.post1"`` -> ``(0, 5, 10)``; junk -> ``()``."""
    parts: list[int] = []
    for piece in text.split("."):
        match = re.match(r"\d+", piece)
        if match is None:
            break
        parts.append(int(match.group()))
        if match.end() != len(piece):
            break
    return tuple(parts)


def sglang_version() -> tuple[int, ...] | None:
    """The installed SGLang distribution's version, or None when it is not installed."""
    try:
        return parse_version(importlib.metadata.version("sglang"))
    except importlib.metadata.PackageNotFoundError:
        return None


def version_text(version: tuple[int, ...] | None) -> str:
    return "not installed" if version is None else ".".join(str(p) for p in version)


def check_supported(version: tuple[int, ...] | None, num_dp_ranks: int) -> None:
    """Raise :class:`IncompatibleSGLang` when this SGLang cannot host the plugin for ``num_dp_ranks``."""
    shown = version_text(version)
    if version is None or version < MIN_PLUGIN_VERSION:
        raise IncompatibleSGLang(
            f"sglang_kvpub: SGLang {shown} has no plugin system (needs >= "
            f"{version_text(MIN_PLUGIN_VERSION)}); {SIDECAR_HINT}"
        )
    if num_dp_ranks > 1 and version < MIN_DP_CONTROLLER_VERSION:
        raise IncompatibleSGLang(
            f"sglang_kvpub: SGLang {shown} does not load plugins in its DataParallelController "
            f"(needs >= {version_text(MIN_DP_CONTROLLER_VERSION)} for {num_dp_ranks} DP ranks); "
            f"{SIDECAR_HINT}"
        )


def hook_api() -> tuple[Any, Any]:
    """``(HookRegistry, HookType)`` from SGLang's plugin package (imported here, lazily)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    return HookRegistry, HookType


def kv_events_module() -> Any:
    """SGLang's ``sglang.srt.disaggregation.kv_events`` (its KVEventBatch, BlockStored...) when
    SGLang imports on this machine (slow: seconds), else None."""
    try:
        from sglang.srt.disaggregation import kv_events
    except Exception:  # not installed, or its imports fail on this machine
        return None
    return kv_events


def raw_num_dp_ranks(args: Any) -> int:
    """DP ranks from raw (unresolved) CLI args: ``dp_size * attn_dp_size``.

    The deprecated ``--dp-size N --enable-dp-attention`` resolves to ``attn_dp_size=N,
    dp_size=1``; the raw product is N either way.
    """
    dp_size = getattr(args, "dp_size", 1) or 1
    attn_dp_size = getattr(args, "attn_dp_size", 1) or 1
    return int(dp_size) * int(attn_dp_size)


def _runtime() -> Any:
    try:
        from sglang.srt import runtime_context
    except ImportError as exc:  # older SGLang: no runtime context accessors
        raise IncompatibleSGLang(
            f"sglang_kvpub: SGLang {version_text(sglang_version())} has no sglang.srt.runtime_context "
            f"(tested with {version_text(TESTED_VERSION)}); {SIDECAR_HINT}"
        ) from exc
    return runtime_context


def _block_size(runtime_context: Any) -> int:
    """``page_size * dcp_size`` of the published server args (SGLang's kv_event_block_size_of)."""
    server_args = runtime_context.get_server_args()
    try:
        from sglang.srt.arg_groups.overrides import kv_event_block_size_of, resolving_view

        return int(kv_event_block_size_of(resolving_view(server_args)))
    except (ImportError, AttributeError):
        page = getattr(server_args, "page_size", None) or 1
        return int(page) * int(getattr(server_args, "dcp_size", 1) or 1)


def _joins_by_scale(runtime_context: Any) -> tuple[bool, bool]:
    """``(ep_join_mode == "scale", is_ep_scale_joiner)``; both False where SGLang lacks them."""
    try:
        moe = runtime_context.get_exec().moe
    except AttributeError:
        return False, False
    return getattr(moe, "ep_join_mode", None) == "scale", bool(getattr(moe, "is_ep_scale_joiner", False))


def _read(parallel: Any, name: str, default: Any) -> Any:
    """A ParallelContext field, or ``default`` where this SGLang lacks or has not set it."""
    try:
        return getattr(parallel, name)
    except (AttributeError, ValueError, RuntimeError):
        return default


def scheduler_topology() -> Topology:
    """In a scheduler process: the engine's DP ranks, whether a DP controller runs, block size.

    Mirrors Engine._launch_scheduler_processes: a DP controller runs iff
    ``num_dp_ranks > 1`` or EP joins in scale mode.
    """
    runtime_context = _runtime()
    parallel = runtime_context.get_parallel()
    num = int(parallel.num_dp_ranks)
    scale, joiner = _joins_by_scale(runtime_context)
    return Topology(
        num_dp_ranks=num,
        uses_dp_controller=num > 1 or scale,
        block_size=_block_size(runtime_context),
        node_rank=int(_read(parallel, "node_rank", 0) or 0),
        is_scale_joiner=joiner,
    )


def controller_topology() -> Topology:
    """In the DataParallelController process (context published before the controller is built)."""
    return scheduler_topology()


@dataclasses.dataclass(frozen=True)
class LoadBalanceInputs:
    """What decides the DP controller's method (core/load_balance.py), from a ServerArgs."""

    requested_method: str  # the operator's --load-balance-method (raw input; "auto" unless given)
    resolved_method: str | None  # what resolution made of it (None: not resolved)
    disaggregation_mode: str | None
    num_dp_ranks: int


def load_balance_inputs(server_args: Any) -> LoadBalanceInputs:
    """Reads raw and resolved values through SGLang's ``resolution_result`` (0.5.23's
    declarations; the raw field stays the operator's input)."""
    requested = str(getattr(server_args, "load_balance_method", None) or "auto")
    try:
        from sglang.srt.arg_groups.overrides import resolution_result

        resolved = str(resolution_result(server_args, "load_balance_method") or "") or None
        mode = resolution_result(server_args, "disaggregation_mode")
    except (ImportError, AttributeError, TypeError, KeyError):  # older SGLang: fields resolved in place
        resolved = requested
        mode = getattr(server_args, "disaggregation_mode", None)
    if resolved == "auto":
        resolved = None
    return LoadBalanceInputs(requested, resolved, None if mode is None else str(mode), raw_num_dp_ranks(server_args))


def declare_load_balance_method(server_args: Any, method: str) -> None:
    """Declares ``load_balance_method`` as SGLang's own resolution handlers do (last writer
    wins; carried with the record to every spawned process).  Before publication only."""
    from sglang.srt.arg_groups.overrides import declare_resolution

    declare_resolution(server_args, "sglang_kvpub.pd_prefill_dispatch", load_balance_method=method)
