"""Every plugin hook contains its own failures: one test per hook.

For each hook a failure is injected into the plugin's part; the test checks that SGLang's
own behaviour still happens (the original's result, the engine's call goes on), that the
failure is logged once with its cause, counted in ``guard.stats()``, and that the feature
stays off: the next call runs SGLang's path without touching the plugin's code again.
The release and reconcile hooks run on SGLang 0.5.23's real tree classes, the Rust core
included, whose ``root_node`` raises NotImplementedError.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Iterator
from typing import Any

import pytest
from sglang_real import requires_radix_cache

from sglang_kvpub.config import ConfigError
from sglang_kvpub.engine import guard, plugin, reconcile, release_hooks, sglang_compat, tree_cores

pytestmark = pytest.mark.unit

GOOD_CONFIG = '{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557"}'


@pytest.fixture(autouse=True)
def fresh_guard() -> Iterator[None]:
    guard.reset()
    reconcile._idle_due[0] = 0.0  # the idle hook's next check: due now
    yield
    guard.reset()


class Boom(RuntimeError):
    pass


def _failed_once(caplog: pytest.LogCaptureFixture, feature: str, cause: str) -> None:
    lines = [r for r in caplog.records if r.levelno == logging.ERROR and f"{feature} hook failed" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert cause in lines[0].getMessage() and lines[0].exc_info is not None
    assert guard.disabled(feature)
    assert feature in guard.stats()["disabled"] and cause in guard.stats()["causes"][feature]


def test_step_publish_failure_drops_batches_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[Any] = []

    class Rank:
        def publish(self, events: Any) -> None:
            calls.append(events)
            raise Boom("encoder broke")

        def shutdown(self) -> None:
            pass

    publisher = plugin.KvPubEventPublisher(Rank())
    publisher.publish(["batch 1"])  # the scheduler's flush: must not raise
    publisher.publish(["batch 2"])
    assert calls == [["batch 1"]]  # off after the first failure
    assert publisher.dropped == 2 and guard.stats()["failures"][guard.STEP] == 1
    _failed_once(caplog, guard.STEP, "encoder broke")
    publisher.shutdown()


def test_idle_hook_failure_returns_sglang_result(caplog: pytest.LogCaptureFixture) -> None:
    touched = [0]

    class Scheduler:
        @property
        def tree_cache(self) -> Any:
            touched[0] += 1
            raise Boom("scheduler shape changed")

    assert reconcile._idle_hook("on_idle result", Scheduler()) == "on_idle result"
    assert reconcile._idle_hook("again", Scheduler()) == "again"
    assert touched == [1]
    _failed_once(caplog, guard.IDLE, "scheduler shape changed")


def test_idle_hook_checks_at_most_every_interval_unless_a_repair_is_under_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr(reconcile, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    runs: list[bool] = []
    under_way = [False]

    def one_slice(scheduler: Any) -> bool:
        runs.append(under_way[0])
        return under_way[0]

    monkeypatch.setattr(reconcile, "reconcile_on_idle", one_slice)
    for _ in range(1000):  # an idle scheduler spinning: one check per interval
        reconcile._idle_hook(None, object())
    assert len(runs) == 1
    now[0] += reconcile.IDLE_CHECK_INTERVAL_S
    reconcile._idle_hook(None, object())
    assert len(runs) == 2
    under_way[0] = True  # a repair started: every idle call continues it
    now[0] += reconcile.IDLE_CHECK_INTERVAL_S
    for _ in range(5):
        reconcile._idle_hook(None, object())
    assert runs[2:] == [True] * 5
    under_way[0] = False  # finished: back to the interval
    reconcile._idle_hook(None, object())
    reconcile._idle_hook(None, object())
    assert len(runs) == 8


def test_reconcile_failure_disables_reconciliation_only(caplog: pytest.LogCaptureFixture) -> None:
    class RadixCache:  # classified as the legacy tree by name; its walk finds no root
        kv_events = types.SimpleNamespace(enabled=True, _queue=[])
        evictable_size_ = protected_size_ = 0
        page_size = 1

        @property
        def root_node(self) -> Any:
            raise Boom("no root here")

    tree = RadixCache()
    tree.kv_events.__dict__["_kvpub_tracker"] = release_hooks.Tracker()
    tree.kv_events._kvpub_tracker.gpu[1] = 0  # one phantom block: drift, so a walk starts
    scheduler = types.SimpleNamespace(tree_cache=tree)
    assert reconcile._idle_hook(None, scheduler) is None
    assert reconcile._idle_hook(None, scheduler) is None
    _failed_once(caplog, guard.RECONCILE, "no root here")
    assert not guard.disabled(guard.IDLE)
    assert guard.stats()["failures"][guard.RECONCILE] == 1


def test_dispatch_failure_falls_back_to_sglang_policy(caplog: pytest.LogCaptureFixture) -> None:
    from sglang_kvpub.core.dispatch import REASON_ERROR, CacheAwareDispatcher
    from sglang_kvpub.engine.dispatch_hook import CONTROLLER_ATTR, _dispatch_hook

    dispatcher = CacheAwareDispatcher(2, 4)
    chosen: list[Any] = []

    def choose(*args: Any, **kwargs: Any) -> Any:
        chosen.append(args)
        raise Boom("index broke")

    dispatcher.choose = choose  # type: ignore[method-assign]
    controller = types.SimpleNamespace(
        workers=["w0", "w1"],
        status=[True, True],
        _active_workers=[0, 1],
        maybe_external_dp_rank_routing=lambda req: False,
        **{CONTROLLER_ATTR: dispatcher},
    )
    sent: list[Any] = []

    def original(self: Any, req: Any) -> str:
        sent.append(req)
        return "round robin"

    req = types.SimpleNamespace(input_ids=list(range(16)), rid="r1")
    assert _dispatch_hook(original, controller, req) == "round robin"
    assert _dispatch_hook(original, controller, req) == "round robin"
    assert sent == [req, req] and len(chosen) == 1
    assert dispatcher.stats()["decisions"][REASON_ERROR] == 1
    _failed_once(caplog, guard.DISPATCH, "index broke")


def test_dispatch_feed_failure_stops_feeding(caplog: pytest.LogCaptureFixture) -> None:
    from sglang_kvpub.core.dispatch import CacheAwareDispatcher
    from sglang_kvpub.engine.dispatch_hook import feed_from_fanin
    from sglang_kvpub.wire import EventBatch

    observers: list[Any] = []
    fanin = types.SimpleNamespace(add_observer=lambda on_batch, on_restart: observers.append(on_batch))
    dispatcher = CacheAwareDispatcher(2, 4)
    seen: list[Any] = []

    def observe(batch: Any, rank: Any) -> None:
        seen.append(rank)
        raise Boom("observe broke")

    dispatcher.observe = observe  # type: ignore[method-assign]
    feed_from_fanin(fanin, dispatcher)
    observers[0](1, EventBatch(1.0, [], 1))
    observers[0](1, EventBatch(1.0, [], 1))
    assert seen == [1]
    _failed_once(caplog, guard.DISPATCH, "observe broke")


def test_describe_failure_keeps_sglang_block(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugin.ENABLED_ENV, "1")
    block = {"publisher": "zmq", "endpoint_port_base": 5557}
    monkeypatch.setattr(plugin, "describe_instance_stream", lambda d: (_ for _ in ()).throw(Boom("describe broke")))
    assert plugin._describe_hook(block, None) is block
    assert plugin._describe_hook(block, None) is block
    _failed_once(caplog, guard.DESCRIBE, "describe broke")


def test_describe_reports_tree_core_and_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugin.ENABLED_ENV, "1")
    monkeypatch.setenv(tree_cores.BACKEND_ENV, "rust")
    described = plugin._describe_hook(
        {"publisher": "zmq", "endpoint_port_base": 5557}, types.SimpleNamespace(device="cpu")
    )
    assert described is not None and described["tree_core"]["core"] == "rust"
    assert described["tree_core"]["limits"] and described["plugin_failures"][guard.STEP] == 0
    npu = plugin._describe_hook({"publisher": "zmq"}, types.SimpleNamespace(device="npu"))
    assert npu is not None and npu["tree_core"] == tree_cores.describe("python")


def test_factory_failure_falls_back_to_sglang_publisher(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(plugin.ENABLED_ENV, "1")
    attempts = [0]

    def start(config: str, rank: int) -> Any:
        attempts[0] += 1
        raise Boom("channel dir not writable")

    monkeypatch.setattr(plugin, "_start_rank_publisher", start)
    sglang_own = object()
    original = lambda cls, config, rank: sglang_own  # noqa: E731 - SGLang's factory
    assert plugin._factory_create_hook(original, object, GOOD_CONFIG, 0) is sglang_own
    assert plugin._factory_create_hook(original, object, GOOD_CONFIG, 1) is sglang_own
    assert attempts == [1]
    _failed_once(caplog, guard.FACTORY, "channel dir not writable")


def test_factory_bad_config_still_stops_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugin.ENABLED_ENV, "1")
    with pytest.raises(ConfigError, match="heartbeat_s"):
        plugin._factory_create_hook(lambda *a: None, object, '{"publisher": "zmq", "heartbeat_s": -1}', 0)
    assert not guard.disabled(guard.FACTORY)


def test_fanin_start_failure_leaves_the_controller_serving(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(plugin.ENABLED_ENV, "1")
    topology = sglang_compat.Topology(num_dp_ranks=2, uses_dp_controller=True, block_size=16)
    monkeypatch.setattr(sglang_compat, "controller_topology", lambda: topology)

    def start(config: Any, topo: Any) -> Any:
        raise OSError("Address already in use")

    monkeypatch.setattr(plugin, "start_controller_fanin", start)
    built: list[Any] = []
    controller = types.SimpleNamespace(workers=[1, 2])
    server_args = types.SimpleNamespace(kv_events_config=GOOD_CONFIG)
    plugin._controller_init_hook(lambda self, *a: built.append(a), controller, server_args)
    assert built and controller.kvpub_fanin is None
    assert getattr(controller, "kvpub_dispatcher", None) is not None  # dispatch (load only) still attached
    _failed_once(caplog, guard.FANIN, "Address already in use")


# --------------------------------------------------------------------------- real trees


@requires_radix_cache
def test_release_hook_failure_keeps_sglang_operation(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench import rh_trees

    ns = rh_trees.setup()
    tree = rh_trees.legacy_tree(ns, 4)
    rh_trees.insert(ns, tree, list(range(40)))
    calls = [0]

    def absorb(self: Any, queue: Any) -> None:
        calls[0] += 1
        raise Boom("tracker broke")

    monkeypatch.setattr(release_hooks.Tracker, "absorb", absorb)
    tree.evict(ns.base.EvictParams(num_tokens=8))  # SGLang's eviction still runs
    events = tree.take_events()
    assert any(type(e).__name__ == "BlockRemoved" for e in events)  # SGLang's own event
    tree.evict(ns.base.EvictParams(num_tokens=8))
    tree.take_events()
    assert calls == [1]
    _failed_once(caplog, guard.RELEASE, "tracker broke")


@requires_radix_cache
def test_rust_core_idle_does_not_crash_and_watches_drift(caplog: pytest.LogCaptureFixture) -> None:
    """The first idle step on the Rust core, whose root_node raises NotImplementedError,
    must not crash: one start line names the core's limits; drift is followed from the
    core's own events and counters; a lost event shows as drift, logged."""
    from bench import rh_trees

    ns = rh_trees.setup()
    params = ns.params.CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=rh_trees.CpuAllocator(),
        page_size=4,
        enable_kv_cache_events=True,
        tree_components=(ns.ct.FULL,),
        tree_core_backend="rust",
    )
    tree = ns.unified.UnifiedRadixCache(params)
    assert tree_cores.core_kind(tree) == tree_cores.RUST
    with pytest.raises(NotImplementedError):
        release_hooks.tree_of(tree).root_node  # noqa: B018 - what crashed the scheduler
    scheduler = types.SimpleNamespace(tree_cache=tree)
    caplog.set_level(logging.INFO)
    reconcile.reconcile_on_idle(scheduler)  # first idle, empty tree
    watch = release_hooks.tree_of(tree).__dict__[reconcile._IDLE_WORK]
    assert isinstance(watch, reconcile.EventDriftWatch) and watch.baseline_ok
    assert sum("rust tree core" in r.getMessage() for r in caplog.records) == 1
    for n in range(6):
        rh_trees.insert(ns, tree, [1000 * n + i for i in range(16)])
    tree.evict(ns.base.EvictParams(num_tokens=16))
    assert tree.take_events()  # the scheduler's flush, through the wrapped recorder
    reconcile.reconcile_on_idle(scheduler)
    assert watch.drift() == 0 and watch.drift_seen == 0 and watch.drift_checks == 2
    rh_trees.insert(ns, tree, list(range(50_000, 50_016)))
    release_hooks.tree_of(tree)._binding.take_events()  # lost: never reached the recorder
    reconcile.reconcile_on_idle(scheduler)
    assert watch.drift() == -4 and watch.drift_seen == 1
    assert any("no walkable tree to repair it" in r.getMessage() for r in caplog.records)
    assert guard.stats()["disabled"] == []
