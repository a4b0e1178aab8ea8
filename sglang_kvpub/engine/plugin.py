"""The SGLang edge: ``--plugin sglang_kvpub`` through SGLang's own plugin system.

SGLang calls :func:`register` (entry point group ``sglang.srt.plugins``) from
``load_plugins()`` in every process it starts: the launcher (``python -m
sglang.launch_server`` / ``sglang serve``, before argument parsing), each scheduler, the
DataParallelController (0.5.22+) and the detokenizer.  What happens where:

- Always (light, behaviour-neutral): ``ServerArgs.add_cli_args`` gains ``--plugin NAME``
  (repeatable) and ``ServerArgs.from_cli_args`` reads it.  Without ``--plugin
  sglang_kvpub`` nothing else is hooked, so SGLang runs exactly as without the plugin.
- Launcher, on ``--plugin sglang_kvpub``: validates the SGLang version and the
  ``--kv-events-config`` (errors name the version or key, and the fallback), sets
  ``SGLANG_KVPUB_ENABLED=1`` in the environment and hooks ``/server_info``.  The schedulers
  and the DP controller are started with ``spawn`` and inherit the environment, so their
  own ``register()`` sees the plugin enabled.  (Without the CLI, e.g. ``sglang.Engine``,
  set ``SGLANG_KVPUB_ENABLED=1`` yourself.)
- Scheduler (enabled): ``EventPublisherFactory.create`` serves ``"publisher": "zmq"``
  (and ``"sglang_kvpub"``) with a :class:`~sglang_kvpub.publish.rank_publisher.RankPublisher`
  on the internal channel instead of a PUB on ``base + rank``; without a DP controller
  (one DP rank) the same process also runs the fan-in.
- DataParallelController (enabled, node 0): the :class:`~sglang_kvpub.publish.fanin.FanIn` starts
  before the schedulers: one PUB on the operator's endpoint, replay on replay_endpoint.
- Any process answering ``/server_info`` (enabled): the ``kv_events`` block describes the
  instance stream (see :func:`describe_instance_stream`).

The publisher config is SGLang's own ``--kv-events-config`` (passed unchanged to every
process in server_args); plugin keys may sit in that JSON or come from ``SGLANG_KVPUB_*``.

Why one module over 450 lines (just): :func:`register` and the per-process hooks it installs
above are the plugin's whole SGLang surface, read together with docs/plugin.md.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

from sglang_kvpub.config import ConfigError, PluginConfig
from sglang_kvpub.core.load_balance import DispatchPlan, plan_dispatch
from sglang_kvpub.engine import guard, sglang_compat, tree_cores
from sglang_kvpub.engine.publishers import describe_publishers

__all__ = [
    "PLUGIN_NAME",
    "ENABLED_ENV",
    "SERVED_PUBLISHERS",
    "register",
    "is_enabled",
    "enable",
    "validate_launch",
    "describe_instance_stream",
    "KvPubEventPublisher",
    "start_controller_fanin",
    "dispatch_plan",
]

log = logging.getLogger(__name__)

PLUGIN_NAME = "sglang_kvpub"
ENABLED_ENV = "SGLANG_KVPUB_ENABLED"
# Publisher names in --kv-events-config the plugin serves when enabled.
SERVED_PUBLISHERS = frozenset({"zmq", PLUGIN_NAME})
_TRUE = frozenset({"1", "true", "yes", "on"})

_lock = threading.Lock()
_cli_registered = False
_runtime_registered: set[str] = set()


# --------------------------------------------------------------------------- entry point


def register() -> None:
    """SGLang's plugin entry point; light and idempotent, imports SGLang lazily."""
    global _cli_registered
    with _lock:
        registry, hook_type = sglang_compat.hook_api()
        if not _cli_registered:
            registry.register(sglang_compat.TARGET_ADD_CLI_ARGS, _add_cli_args_hook, hook_type.AROUND)
            registry.register(sglang_compat.TARGET_FROM_CLI_ARGS, _from_cli_args_hook, hook_type.AROUND)
            _cli_registered = True
        if is_enabled():
            _register_runtime_hooks(registry, hook_type)


def is_enabled(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return env.get(ENABLED_ENV, "").strip().lower() in _TRUE


def enable() -> None:
    """Mark the plugin enabled for this process and every process it spawns; hook what is loaded.

    Called after SGLang's ``load_plugins()`` has already applied hooks, so it applies the
    runtime hooks itself (``apply_hooks`` skips targets already patched).
    """
    os.environ[ENABLED_ENV] = "1"
    registry, hook_type = sglang_compat.hook_api()
    with _lock:
        _register_runtime_hooks(registry, hook_type)
    registry.apply_hooks()


def _runtime_hooks() -> list[tuple[str, Callable[..., Any], str, str | None]]:
    """(target, hook, hook type name, module that must already be loaded or None)."""
    return [
        (sglang_compat.TARGET_FACTORY_CREATE, _factory_create_hook, "AROUND", None),
        (sglang_compat.TARGET_DESCRIBE, _describe_hook, "AFTER", None),
        # The launcher's last look at the config before SGLang publishes it (every path).
        (sglang_compat.TARGET_CHECK_SERVER_ARGS, _check_server_args_hook, "AROUND", None),
        # Importing the controller drags in the whole scheduler stack: only hook it in
        # the process that runs it (its module is loaded before it calls load_plugins).
        (
            sglang_compat.TARGET_DP_CONTROLLER_INIT,
            _controller_init_hook,
            "AROUND",
            "sglang.srt.managers.data_parallel_controller",
        ),
    ]


def _register_runtime_hooks(registry: Any, hook_type: Any) -> None:
    for target, hook, kind, needs_module in _runtime_hooks():
        if target in _runtime_registered:
            continue
        if needs_module is not None and needs_module not in sys.modules:
            continue
        registry.register(target, hook, getattr(hook_type, kind))
        _runtime_registered.add(target)
    _register_release_hooks(registry)
    if CONTROLLER_MODULE in sys.modules:
        from sglang_kvpub.engine.dispatch_hook import install_dispatch_hook

        install_dispatch_hook(registry, hook_type)  # idempotent; inert until attach_dispatcher


CONTROLLER_MODULE = "sglang.srt.managers.data_parallel_controller"


SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
_RELEASE_HOOKS = "release-hooks"


def _register_release_hooks(registry: Any) -> None:
    """HBM-release truth (docs/hbm-release.md): only in scheduler processes, which own a tree.

    The scheduler module is loaded before it calls ``load_plugins()``; other processes
    (launcher, detokenizer, DP controller) never pay for importing the tree classes.
    """
    if _RELEASE_HOOKS in _runtime_registered or SCHEDULER_MODULE not in sys.modules:
        return
    from sglang_kvpub.engine.reconcile import install_reconcile_hook
    from sglang_kvpub.engine.release_hooks import install_release_hooks

    hooked = install_release_hooks(registry)
    install_reconcile_hook(registry)
    _runtime_registered.add(_RELEASE_HOOKS)
    log.info("sglang_kvpub: HBM-release hooks on %d tree methods, idle-time reconciliation on", len(hooked))
    from sglang_kvpub.engine.pd_register import install_register_hook

    # Only where SGLang's PD connection module is loaded (it is with the scheduler's imports).
    install_register_hook(registry, sglang_compat.hook_api()[1])


# --------------------------------------------------------------------------- CLI


def _add_cli_args_hook(original: Callable[..., Any], parser: argparse.ArgumentParser, *args: Any) -> Any:
    result = original(parser, *args)
    add_plugin_argument(parser)
    return result


def add_plugin_argument(parser: argparse.ArgumentParser) -> None:
    """``--plugin NAME`` (repeatable); joins an existing ``--plugin`` another plugin added."""
    existing = parser._option_string_actions.get("--plugin")
    if existing is not None:
        choices = list(existing.choices or [])
        if PLUGIN_NAME not in choices:
            existing.choices = [*choices, PLUGIN_NAME]
        return
    parser.add_argument(
        "--plugin",
        action="append",
        choices=[PLUGIN_NAME],
        default=None,
        metavar="NAME",
        help=(
            f"Enable an installed plugin that is off by default. {PLUGIN_NAME}: one instance-level "
            "KV-event stream for all DP ranks on the --kv-events-config endpoint. Repeatable."
        ),
    )


def _from_cli_args_hook(original: Callable[..., Any], cls: Any, args: argparse.Namespace, *rest: Any) -> Any:
    if PLUGIN_NAME in (getattr(args, "plugin", None) or []):
        validate_launch(
            getattr(args, "kv_events_config", None),
            num_dp_ranks=sglang_compat.raw_num_dp_ranks(args),
            nnodes=int(getattr(args, "nnodes", 1) or 1),
        )
        enable()
        log.info("sglang_kvpub enabled: one instance KV-event stream for all DP ranks")
        _log_tree_core(getattr(args, "device", None))
    return original(cls, args, *rest)


def _log_tree_core(device: str | None) -> None:
    """The one start line naming what the predicted tree core cannot guarantee."""
    core = tree_cores.predict_core(device)
    where = f"{tree_cores.BACKEND_ENV}={os.environ.get(tree_cores.BACKEND_ENV, 'rust (default)')}, --device {device}"
    line = tree_cores.limit_line(core, where)
    if line is not None:
        log.warning("%s", line)


def validate_launch(
    kv_events_config: str | None,
    *,
    num_dp_ranks: int,
    nnodes: int = 1,
    version: tuple[int, ...] | None = None,
    env: Mapping[str, str] | None = None,
) -> PluginConfig:
    """Everything that can be checked in the launcher, before any process starts.

    Raises :class:`~sglang_kvpub.engine.sglang_compat.IncompatibleSGLang` (version + fallback)
    or :class:`~sglang_kvpub.config.ConfigError` (key + fix).
    """
    sglang_compat.check_supported(version if version is not None else sglang_compat.sglang_version(), num_dp_ranks)
    if not kv_events_config:
        raise ConfigError(
            f"--plugin {PLUGIN_NAME} needs --kv-events-config, e.g. "
            '\'{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\''
        )
    name = _publisher_name(kv_events_config)
    if name not in SERVED_PUBLISHERS:
        raise ConfigError(
            f"--kv-events-config key 'publisher' = {name!r}: {PLUGIN_NAME} serves "
            f'{sorted(SERVED_PUBLISHERS)}; set "publisher": "zmq"'
        )
    config = PluginConfig.from_kv_events_json(kv_events_config, env)
    if nnodes > 1 and config.internal_channel is None:
        raise ConfigError(
            f"key 'internal_channel' (env SGLANG_KVPUB_INTERNAL_CHANNEL) is unset but --nnodes {nnodes}: "
            "ranks on other nodes cannot reach the fan-in over ipc; set it to "
            "'tcp://<node 0 address>:<free port>'"
        )
    return config


def _publisher_name(kv_events_config: str) -> str:
    try:
        data = json.loads(kv_events_config)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--kv-events-config is not valid JSON ({exc.msg} at char {exc.pos}): fix the JSON") from exc
    if not isinstance(data, dict):
        raise ConfigError('--kv-events-config must be a JSON object like {"publisher": "zmq", ...}')
    return str(data.get("publisher", "null"))


# --------------------------------------------------------------------------- load-balance method


def dispatch_plan(
    server_args: Any, *, resolved_method: str | None = None, num_dp_ranks: int | None = None, switchable: bool = True
) -> DispatchPlan:
    """The dispatch outcome for ``server_args`` (``resolved_method``, ``num_dp_ranks``: what a
    running controller actually runs, which wins over the config)."""
    inputs = sglang_compat.load_balance_inputs(server_args)
    kv_events_config = getattr(server_args, "kv_events_config", None)
    return plan_dispatch(
        dp_dispatch=PluginConfig.from_kv_events_json(kv_events_config or "").dp_dispatch,
        requested_method=inputs.requested_method,
        resolved_method=resolved_method or inputs.resolved_method,
        disaggregation_mode=inputs.disaggregation_mode,
        num_dp_ranks=inputs.num_dp_ranks if num_dp_ranks is None else num_dp_ranks,
        switchable=switchable,
    )


def _check_server_args_hook(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    """On a PD prefill with ``--load-balance-method auto``, declare round_robin so that the
    plugin dispatches and the decode asks the bootstrap server for the rank
    (core/load_balance.py).  Contained: a failure leaves SGLang's method, and the DP
    controller then says dispatch is off."""
    result = original(self, *args, **kwargs)
    if not is_enabled() or guard.disabled(guard.DISPATCH):
        return result
    try:
        plan = dispatch_plan(self)
        if plan.switch_to is not None:
            sglang_compat.declare_load_balance_method(self, plan.switch_to)
        log.info("sglang_kvpub: %s", plan.line())
    except Exception as exc:
        guard.fail(guard.DISPATCH, exc)
    return result


# --------------------------------------------------------------------------- scheduler


class KvPubEventPublisher:
    """What SGLang's scheduler holds instead of its ZmqEventPublisher (same duck type).

    ``publish`` hands the batch to the rank publisher (never blocks).  With no DP
    controller in the engine, ``fanin`` serves the instance stream from this process.
    """

    def __init__(self, rank: Any, fanin: Any | None = None) -> None:
        self.rank = rank
        self.fanin = fanin
        self.dropped = 0  # batches not handed on once the step feature is off
        self._closed = False
        atexit.register(self.shutdown)

    @classmethod
    def start(cls, config: PluginConfig, dp_rank: int, block_size: int, *, serve_stream: bool) -> KvPubEventPublisher:
        from sglang_kvpub.publish.fanin import FanIn
        from sglang_kvpub.publish.rank_publisher import RankPublisher

        fanin = None
        if serve_stream:
            # Bind the channel before the rank connects, so nothing is lost at start.
            fanin = FanIn(config, 1)
            fanin.start()
        try:
            rank = RankPublisher(config, dp_rank, block_size, _channel_of(config, fanin))
        except BaseException:
            if fanin is not None:
                fanin.stop()
            raise
        return cls(rank, fanin)

    def publish(self, events: Any) -> None:
        # The scheduler's flush calls this every step: a failure here must not reach it.
        if guard.STEP in guard._disabled:
            self.dropped += 1
            return
        try:
            self.rank.publish(events)
        except Exception as exc:
            self.dropped += 1
            guard.fail(guard.STEP, exc)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.rank.shutdown()
        if self.fanin is not None:
            self.fanin.stop()

    def describe_local_source(self, block_size: int) -> dict[str, Any] | None:
        # No per-rank socket exists any more; the instance stream is in /server_info.
        return None


def _channel_of(config: PluginConfig, fanin: Any | None) -> str:
    if fanin is not None:
        return str(fanin.channel_endpoint)
    from sglang_kvpub.transport.channel import resolve_channel_endpoint

    return resolve_channel_endpoint(config)


def _factory_create_hook(
    original: Callable[..., Any], cls: Any, config: str | None = None, attn_dp_rank: int = 0
) -> Any:
    """``EventPublisherFactory.create``: ours for served publishers when enabled, else SGLang's.

    A bad configuration stops the start (named key); any other failure of ours falls back
    to SGLang's own per-rank publisher, logged once and counted (guard.py)."""
    if guard.disabled(guard.FACTORY) or not is_enabled() or not config:
        return original(cls, config, attn_dp_rank)
    if _publisher_name(config) not in SERVED_PUBLISHERS:
        return original(cls, config, attn_dp_rank)
    try:
        publisher = _start_rank_publisher(config, attn_dp_rank)
    except (ConfigError, sglang_compat.IncompatibleSGLang):
        raise
    except Exception as exc:
        guard.fail(guard.FACTORY, exc)
        publisher = None
    # SGLang's factory runs outside the guarded part: its own errors stay SGLang's.
    return publisher if publisher is not None else original(cls, config, attn_dp_rank)


def _start_rank_publisher(config: str, attn_dp_rank: int) -> KvPubEventPublisher:
    plugin_config = PluginConfig.from_kv_events_json(config)
    topology = sglang_compat.scheduler_topology()
    publisher = KvPubEventPublisher.start(
        plugin_config,
        attn_dp_rank,
        topology.block_size,
        serve_stream=not topology.uses_dp_controller,
    )
    log.info(
        "sglang_kvpub: rank %d publishes to the fan-in on %s (block_size %d%s)",
        attn_dp_rank,
        publisher.rank.channel_endpoint,
        topology.block_size,
        ", serving the instance stream here" if publisher.fanin is not None else "",
    )
    return publisher


# --------------------------------------------------------------------------- DP controller


def start_controller_fanin(kv_events_config: str | None, topology: sglang_compat.Topology) -> Any | None:
    """The fan-in the DataParallelController runs, or None when this controller runs none."""
    if not kv_events_config or _publisher_name(kv_events_config) not in SERVED_PUBLISHERS:
        return None
    if topology.node_rank != 0 or topology.is_scale_joiner:
        return None  # node 0's controller serves the instance; others only dispatch
    from sglang_kvpub.publish.fanin import FanIn

    fanin = FanIn(PluginConfig.from_kv_events_json(kv_events_config), topology.num_dp_ranks)
    fanin.start()
    atexit.register(fanin.stop)
    return fanin


def _controller_init_hook(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    if not is_enabled():
        return original(self, *args, **kwargs)
    server_args = kwargs.get("server_args", args[0] if args else None)
    kv_events_config = getattr(server_args, "kv_events_config", None)
    fanin = topology = None
    if not guard.disabled(guard.FANIN):
        try:
            topology = sglang_compat.controller_topology()
            fanin = start_controller_fanin(kv_events_config, topology)
        except (ConfigError, sglang_compat.IncompatibleSGLang):
            raise
        except Exception as exc:  # e.g. the instance port is taken: SGLang still serves
            guard.fail(guard.FANIN, exc)
    try:
        result = original(self, *args, **kwargs)
    except BaseException:
        if fanin is not None:
            fanin.stop()
        raise
    self.kvpub_fanin = fanin
    _attach_dispatch(self, server_args, topology, fanin)
    _attach_rank_watch(self)
    if fanin is not None:
        _attach_load_reports(self, fanin)
    return result


def _attach_rank_watch(controller: Any) -> None:
    """The schedulers' liveness (engine/rank_watch.py), contained."""
    if guard.disabled(guard.RANK_WATCH):
        return
    try:
        from sglang_kvpub.engine.rank_watch import attach_rank_watch

        attach_rank_watch(controller)
    except Exception as exc:
        guard.fail(guard.RANK_WATCH, exc)


def _attach_load_reports(controller: Any, fanin: Any) -> None:
    """The ranks' loads on the instance stream (wire.LoadReport), contained: without them the
    router scores by hits alone, as before."""
    try:
        from sglang_kvpub.engine.dispatch_hook import CONTROLLER_ATTR
        from sglang_kvpub.engine.load_report import attach_load_reports

        attach_load_reports(controller, fanin, getattr(controller, CONTROLLER_ATTR, None))
    except Exception as exc:
        log.warning("sglang_kvpub: rank-load messages off: %r", exc)


def _attach_dispatch(controller: Any, server_args: Any, topology: Any, fanin: Any | None) -> None:
    """Cache-aware dispatch (the default; ``dp_dispatch: "default"`` opts out), contained."""
    if guard.disabled(guard.DISPATCH):
        return
    kv_events_config = getattr(server_args, "kv_events_config", None)
    try:
        config = PluginConfig.from_kv_events_json(kv_events_config or "")
        if config.dp_dispatch != "cache_aware":
            log.info('sglang_kvpub: dp_dispatch "default": SGLang\'s --load-balance-method dispatches')
            return
        # What this controller really runs decides (the launcher may not have switched it).
        topology = topology or sglang_compat.controller_topology()
        running = getattr(getattr(controller, "load_balance_method", None), "name", None)
        plan = dispatch_plan(
            server_args,
            resolved_method=running.lower() if running else None,
            num_dp_ranks=topology.num_dp_ranks,
            switchable=False,
        )
        if not plan.on:
            log.info("sglang_kvpub: %s", plan.line())
            return
        from sglang_kvpub.engine.dispatch_hook import DecisionLog, attach_dispatcher

        attach_dispatcher(
            controller,
            block_size=topology.block_size,
            fanin=fanin,
            decision_log=DecisionLog(config.dispatch_log, config.dispatch_log_every),
            pending=config.dp_pending,
            **config.cost(),
        )
        log.info("sglang_kvpub: %s", plan.line())
    except Exception as exc:
        guard.fail(guard.DISPATCH, exc)


# --------------------------------------------------------------------------- /server_info


def describe_instance_stream(descriptor: dict[str, Any] | None) -> dict[str, Any] | None:
    """SGLang's ``kv_events`` block rewritten for the fanned-in instance stream.

    ``endpoint_port_base`` is the one instance port (every rank's batches, dp_rank in the
    third batch field), ``dp_size`` stays the engine's rank count, and ``fanned_in``
    tells tools not to open ``base + rank`` ports.  Other publishers pass through.
    """
    if descriptor is None or descriptor.get("publisher") not in SERVED_PUBLISHERS:
        return descriptor
    result = dict(descriptor)
    result["publisher"] = PLUGIN_NAME
    result["fanned_in"] = True
    result["stream"] = "instance"
    result["endpoint_port"] = result.get("endpoint_port_base")
    if "replay_endpoint_port_base" in result:
        result["replay_endpoint_port"] = result["replay_endpoint_port_base"]
    return result


def _describe_hook(result: dict[str, Any] | None, *args: Any, **kwargs: Any) -> dict[str, Any] | None:
    if not is_enabled() or guard.disabled(guard.DESCRIBE):
        return result
    try:
        described = describe_instance_stream(result)
        if described is not None and described is not result:
            server_args = kwargs.get("server_args", args[0] if args else None)
            device = getattr(server_args, "device", None)
            described["tree_core"] = tree_cores.describe(tree_cores.predict_core(device))
            described["plugin_failures"] = guard.stats()["failures"]
            if server_args is not None:
                plan = dispatch_plan(server_args).as_dict()
                if guard.disabled(guard.DISPATCH):  # the launcher's switch failed here (contained)
                    plan.update(on=False, reason="a contained plugin failure switched dispatch off (see the log)")
                described["dp_dispatch"] = plan
                config = PluginConfig.from_kv_events_json(getattr(server_args, "kv_events_config", None) or "")
                dp_size = int(described.get("dp_size") or 1)
                described["publishers"] = describe_publishers(config, dp_size, getattr(server_args, "host", None))
        return described
    except Exception as exc:
        guard.fail(guard.DESCRIBE, exc)
        return result
