"""Release hooks on SGLang 0.5.23's real RadixCache and UnifiedRadixCache (Python UnifiedTreeCore) on CPU."""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("sglang")
pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from bench import rh_trees as rt
from sglang_kvpub.engine.reconcile import Reconciler, device_pages, drift
from sglang_kvpub.engine.release_hooks import _OUTER_HOOKS, UNIFIED_CORE_CLASS, hook_targets, tree_armed, tree_of
from sglang_kvpub.wire import MEDIUM_CPU, MEDIUM_GPU

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ns = rt.setup  # cached: one real-SGLang setup per process


def _silent_cascade(tree: Any, node: Any, hooked: bool = True) -> None:
    """SGLang's own ``_cascade_evict`` on a Full device leaf: what SWA/Mamba-triggered cascades do.

    It frees the node's Full device KV and records no event (``_demote`` records one
    only after calling it; the SWA/Mamba eviction paths record none).
    """
    core = tree_of(tree)
    full = core.components_by_type[ns().ct.FULL]
    detach = type(core)._evict_component_and_detach_lru
    cascade = type(core)._cascade_evict
    if not hooked:
        detach, cascade = detach.__wrapped__, cascade.__wrapped__
    frees: Any = (defaultdict(list), defaultdict(list), [])
    tracker: Any = defaultdict(int)
    detach(core, node, full, *frees, tracker=tracker)
    cascade(core, node, full, tracker, *frees)


def _a_device_leaf(tree: Any) -> Any:
    core = tree_of(tree)
    leaves = sorted(core.evictable_device_leaves, key=lambda n: n.id)
    return leaves[0] if leaves else None


def _assert_consistent(tree: Any, sub: rt.Subscriber) -> None:
    sub.drain(tree)
    got = sub.media()
    want = rt.truth(tree)
    assert got[MEDIUM_GPU] == want[MEDIUM_GPU]
    assert got[MEDIUM_CPU] == want[MEDIUM_CPU]
    assert len(got[MEDIUM_GPU]) == device_pages(tree)


# --------------------------------------------------------------------------- state machine


class TreeMachine(RuleBasedStateMachine):
    page_size = 4
    unified = True
    armed: bool | None = None  # None: as the tree is (a Full-only unified core is not armed)

    def __init__(self) -> None:
        super().__init__()
        n = ns()
        self.tree = rt.unified_tree(n, self.page_size) if self.unified else rt.legacy_tree(n, self.page_size)
        self.sub = rt.Subscriber()
        if self.armed is not None:
            rt.tracker(self.tree).armed = self.armed  # as if a SWA/Mamba component could cascade

    def _tokens(self, prefix: int, branch: int, length: int) -> list[int]:
        # Few prefixes and branches so requests share and split nodes.
        head = [prefix * 1000 + i for i in range(2 * self.page_size)]
        tail = [branch * 100 + i for i in range(length * self.page_size)]
        return head + tail

    @rule(prefix=st.integers(0, 2), branch=st.integers(0, 3), length=st.integers(0, 4))
    def insert(self, prefix: int, branch: int, length: int) -> None:
        rt.insert(ns(), self.tree, self._tokens(prefix, branch, length))

    @rule(prefix=st.integers(0, 2), branch=st.integers(0, 3), length=st.integers(0, 4))
    def match(self, prefix: int, branch: int, length: int) -> None:
        tokens = self._tokens(prefix, branch, length)
        self.tree.match_prefix(ns().base.MatchPrefixParams(key=rt.key(ns(), tokens[: len(tokens) - self.page_size])))

    @rule(pages=st.integers(1, 6))
    def evict(self, pages: int) -> None:
        self.tree.evict(ns().base.EvictParams(num_tokens=pages * self.page_size))

    @rule()
    def reset(self) -> None:
        self.tree.reset()

    @precondition(lambda self: self.unified)
    @rule()
    def silent_cascade(self) -> None:
        leaf = _a_device_leaf(self.tree)
        if leaf is not None:
            _silent_cascade(self.tree, leaf)

    @invariant()
    def stream_equals_tree(self) -> None:
        _assert_consistent(self.tree, self.sub)


class LegacyMachine(TreeMachine):
    unified = False


class ArmedUnifiedMachine(TreeMachine):
    """The unified core's operations checked at their end (the balance / settle path)."""

    armed = True


_SETTINGS = settings(
    max_examples=12,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

TestUnifiedMachine = TreeMachine.TestCase
TestUnifiedMachine.settings = _SETTINGS
TestLegacyMachine = LegacyMachine.TestCase
TestLegacyMachine.settings = _SETTINGS
TestArmedUnifiedMachine = ArmedUnifiedMachine.TestCase
TestArmedUnifiedMachine.settings = _SETTINGS


# --------------------------------------------------------------------------- focused cases


def test_hook_targets_exist_in_sglang_0523() -> None:
    import pkgutil

    ns()
    for target, _hook in hook_targets():
        owner, method = target.rsplit(".", 1)
        assert callable(getattr(pkgutil.resolve_name(owner), method)), target


def test_sglang_alone_leaves_gpu_stale_and_hooks_fix_it() -> None:
    n = ns()
    for hooked in (False, True):
        tree = rt.unified_tree(n, 4)
        sub = rt.Subscriber()
        rt.insert(n, tree, list(range(1, 17)))
        rt.insert(n, tree, list(range(1, 9)) + [7] * 8)
        sub.drain(tree)
        leaf = _a_device_leaf(tree)
        _silent_cascade(tree, leaf, hooked=hooked)
        sub.drain(tree)
        stale = sub.media()[MEDIUM_GPU] - rt.truth(tree)[MEDIUM_GPU]
        if hooked:
            assert stale == set()
            assert rt.tracker(tree).corrections["release_gpu"] == 2
        else:
            assert len(stale) == 2  # SGLang alone: two pages still announced on GPU
            assert drift(tree) == 2
            Reconciler(tree).run()  # the drift check + walk repairs it
            _assert_consistent(tree, sub)
            assert rt.tracker(tree).corrections["reconcile_stale_gpu"] == 2


def test_native_removal_is_not_duplicated() -> None:
    """``_demote``-style: the cascade frees, SGLang then records its own removal."""
    n = ns()
    tree = rt.unified_tree(n, 4)
    sub = rt.Subscriber()
    rt.insert(n, tree, list(range(1, 13)))
    sub.drain(tree)
    leaf = _a_device_leaf(tree)
    _silent_cascade(tree, leaf)  # hook emits the removal now
    tree_of(tree).kv_events.record_remove(leaf)  # SGLang's later record: stripped
    events = tree.take_events()
    removed = [h for e in events if type(e).__name__ == "BlockRemoved" for h in e.block_hashes]
    assert len(removed) == len(set(removed)) == 3
    assert rt.tracker(tree).corrections["deduped"] == 3


def test_page_128_random_workload_consistent() -> None:
    n = ns()
    rng = random.Random(7)
    for make in (rt.unified_tree, rt.legacy_tree):
        tree = make(n, 128)
        sub = rt.Subscriber()
        for _step in range(60):
            prefix = [rng.randrange(3) * 10_000 + i for i in range(256)]
            tokens = prefix + [rng.randrange(50_000) for _ in range(rng.randrange(0, 4) * 128)]
            op = rng.random()
            if op < 0.6:
                rt.insert(n, tree, tokens)
            elif op < 0.8:
                tree.evict(n.base.EvictParams(num_tokens=rng.randrange(1, 4) * 128))
            elif op < 0.9 and make is rt.unified_tree and _a_device_leaf(tree) is not None:
                _silent_cascade(tree, _a_device_leaf(tree))
            elif op < 0.93:
                tree.reset()
            else:
                tree.match_prefix(n.base.MatchPrefixParams(key=rt.key(n, tokens[:384])))
            _assert_consistent(tree, sub)
        assert sub.events > 0


def test_only_trees_with_cascading_components_are_armed() -> None:
    n = ns()
    assert not tree_armed(tree_of(rt.unified_tree(n, 4)))  # Full only: SGLang records every release
    assert tree_armed(rt.legacy_tree(n, 4))  # legacy: always checked
    hybrid = type("Core", (), {"component_types": (n.ct.FULL, n.ct.SWA)})()
    assert tree_armed(hybrid)


@pytest.mark.parametrize("armed", [True, False])
def test_silent_release_inside_an_operation(armed: bool) -> None:
    """A cascade inside a hooked tree operation: an armed tree's hooks emit the removal when
    the operation ends; a Full-only tree trusts SGLang there, and the drift check repairs."""
    n = ns()
    tree = rt.unified_tree(n, 4)
    sub = rt.Subscriber()
    rt.insert(n, tree, list(range(1, 17)))
    rt.insert(n, tree, list(range(1, 9)) + [7] * 8)
    sub.drain(tree)
    rt.tracker(tree).armed = armed
    leaf = _a_device_leaf(tree)
    operation = _OUTER_HOOKS[UNIFIED_CORE_CLASS]
    operation(lambda core: _silent_cascade(tree, leaf), tree_of(tree))
    sub.drain(tree)
    corrections = rt.tracker(tree).corrections
    if armed:
        assert corrections["release_gpu"] == 2
        assert drift(tree) == 0
    else:
        assert corrections["release_gpu"] == 0
        assert drift(tree) == 2
        Reconciler(tree).run()
        assert corrections["reconcile_stale_gpu"] == 2
    _assert_consistent(tree, sub)
