"""``KvAffinity``: the router-side Python API - streams in, Motor-style decisions out.

One :class:`~sglang_kvpub.core.index.PrefixIndex` is fed by one stream subscriber per HTTP
endpoint (the plugin's instance stream carries every rank), or, for an engine without
the plugin, by one subscriber per rank on ``base + rank`` (compatibility mode).
:meth:`KvAffinity.select` folds each instance's ranks and applies Motor's cost
(:mod:`motor_adapter.scoring`). Subscriber threads are the only writers; any number of
threads may query and select at once.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

import zmq

from motor_adapter.pending_hits import merge_pending, prompt_pending
from motor_adapter.rank_loads import RankLoadBook
from motor_adapter.scoring import Candidate, Decision, KvAffinityConfig, TierCounts, select

if TYPE_CHECKING:
    from sglang_kvpub.core.index import PrefixIndex

__all__ = ["KvAffinity", "NoSubscriber", "SubscriberFactory", "compat_endpoints", "decision_logger"]

decision_logger = logging.getLogger("motor_adapter.decision")
_log = logging.getLogger(__name__)
_NO_HITS: Mapping[str, tuple[int, TierCounts]] = MappingProxyType({})


class _Subscriber(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...

    def health(self) -> Any: ...


SubscriberFactory = Callable[..., _Subscriber]
"""Builds a subscriber like ``motor_adapter.stream.StreamSubscriber`` (same arguments)."""


class NoSubscriber:
    """A subscriber that follows nothing: for a caller that feeds ``KvAffinity.index`` itself
    (simulations, benches, tests) - ``KvAffinity(cfg, subscriber_factory=NoSubscriber)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def health(self) -> None:
        return None


@dataclasses.dataclass(frozen=True)
class _Instance:
    endpoint: str
    replay_endpoint: str | None
    compat_dp_size: int | None
    topic: bytes
    subscribers: tuple[_Subscriber, ...]

    def same_source(self, other: _Instance) -> bool:
        return (self.endpoint, self.replay_endpoint, self.compat_dp_size, self.topic) == (
            other.endpoint,
            other.replay_endpoint,
            other.compat_dp_size,
            other.topic,
        )


def compat_endpoints(endpoint: str, dp_size: int) -> list[str]:
    """``tcp://host:base`` -> ``[tcp://host:base, tcp://host:base+1, ...]`` (SGLang's rank ports)."""
    if dp_size < 1:
        raise ValueError(f"compat_dp_size must be >= 1, got {dp_size}")
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp":
        raise ValueError(f"compatibility mode needs a tcp:// endpoint (ports base+rank), got {endpoint!r}")
    host, _, port_text = parts.netloc.rpartition(":")
    if not host or not port_text.isdigit():
        raise ValueError(f"endpoint {endpoint!r} has no numeric port: write tcp://HOST:PORT")
    base = int(port_text)
    if base + dp_size - 1 > 65535:
        raise ValueError(f"ports {base}..{base + dp_size - 1} of {endpoint!r} exceed 65535")
    return [f"tcp://{host}:{base + rank}" for rank in range(dp_size)]


def _default_index(block_size: int, capacity_blocks: int | None) -> PrefixIndex:
    from sglang_kvpub.core.index import PrefixIndex

    return PrefixIndex(block_size, capacity_blocks=capacity_blocks)


def _default_factory() -> SubscriberFactory:
    from motor_adapter.stream import StreamSubscriber

    return StreamSubscriber


class KvAffinity:
    """Subscribes to prefill instances' KV streams and picks an instance and rank per request.

    ``index`` and ``subscriber_factory`` default to the real
    :class:`~sglang_kvpub.core.index.PrefixIndex` and
    :class:`~motor_adapter.stream.StreamSubscriber`; tests may pass their own.
    """

    def __init__(
        self,
        cfg: KvAffinityConfig,
        capacity_blocks: int | None = None,
        *,
        index: PrefixIndex | None = None,
        subscriber_factory: SubscriberFactory | None = None,
        context: Any = None,
        curve_server_keys: Mapping[str, str] | None = None,
        curve_client_secret_key_file: str | None = None,
    ) -> None:
        """``curve_server_keys``: stream URL -> the fan-in's CURVE public key (docs/security.md)."""
        self.cfg = cfg
        self._curve_keys = dict(curve_server_keys or {})
        self._curve_client_file = curve_client_secret_key_file
        self.index = index if index is not None else _default_index(cfg.block_size, capacity_blocks)
        self.loads = RankLoadBook()  # each instance's rank loads, from its stream's rank-load messages
        self._factory = subscriber_factory
        self._context = context if context is not None else zmq.Context.instance()
        self._instances: dict[str, _Instance] = {}
        self._known: tuple[str, ...] = ()  # the followed ids, replaced (never mutated) under _lock
        self._lock = threading.Lock()  # guards _instances; the index guards itself
        self._closed = False

    # ------------------------------------------------------------------ instances

    def add_instance(
        self,
        instance_id: str,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        compat_dp_size: int | None = None,
        topic: bytes = b"",
    ) -> None:
        """Starts following one instance; re-adding the same source is a no-op, another replaces it.

        ``compat_dp_size`` = N subscribes to ``endpoint``'s port + rank for ranks 0..N-1 (and
        the replay port + rank), attributing each stream to its rank - for engines that run
        without the plugin.
        """
        if not instance_id:
            raise ValueError("instance_id must be a non-empty string")
        wanted = _Instance(endpoint, replay_endpoint, compat_dp_size, topic, ())
        with self._lock:
            if self._closed:
                raise RuntimeError("KvAffinity is closed")
            current = self._instances.get(instance_id)
        if current is not None:
            if current.same_source(wanted):
                return
            self.remove_instance(instance_id)
        subscribers = self._start_subscribers(instance_id, wanted)
        with self._lock:
            stale = self._instances.get(instance_id)
            self._instances[instance_id] = dataclasses.replace(wanted, subscribers=subscribers)
            self._known = tuple(self._instances)
        if stale is not None:  # a concurrent add won the race: ours replaces it
            _stop_all(stale.subscribers)
        _log.info("following instance %s on %s (compat_dp_size=%s)", instance_id, endpoint, compat_dp_size)

    def add_pushed(self, instance_id: str) -> None:
        """Answers for ``instance_id`` with no subscriber: its blocks are written to :attr:`index`
        by the caller (``POST /events``).  :meth:`remove_instance` forgets them."""
        with self._lock:
            if self._closed:
                raise RuntimeError("KvAffinity is closed")
            if instance_id not in self._instances:
                self._instances[instance_id] = _Instance(instance_id, None, None, b"", ())
                self._known = tuple(self._instances)

    def _start_subscribers(self, instance_id: str, spec: _Instance) -> tuple[_Subscriber, ...]:
        factory = self._factory or _default_factory()
        if spec.compat_dp_size is None:
            plans: list[tuple[str, str | None, int | None]] = [(spec.endpoint, spec.replay_endpoint, None)]
        else:
            live = compat_endpoints(spec.endpoint, spec.compat_dp_size)
            replay: list[str | None] = (
                list(compat_endpoints(spec.replay_endpoint, spec.compat_dp_size))
                if spec.replay_endpoint
                else [None] * spec.compat_dp_size
            )
            plans = [(live[r], replay[r], r) for r in range(spec.compat_dp_size)]
        started: list[_Subscriber] = []
        try:
            for live_ep, replay_ep, rank in plans:
                extra = self._curve_options(spec.endpoint)
                sub = factory(
                    instance_id,
                    live_ep,
                    self.index,
                    replay_endpoint=replay_ep,
                    topic=spec.topic,
                    dp_rank_override=rank,
                    context=self._context,
                    load_sink=self.loads.apply,
                    **extra,
                )
                sub.start()
                started.append(sub)
        except BaseException:
            _stop_all(started)
            raise
        return tuple(started)

    def _curve_options(self, endpoint: str) -> dict[str, Any]:
        """``options=`` with the CURVE keys when this stream has a server key, else nothing."""
        key = self._curve_keys.get(endpoint)
        if key is None:
            return {}
        from motor_adapter.stream import StreamOptions

        options = StreamOptions(curve_server_key=key, curve_client_secret_key_file=self._curve_client_file)
        return {"options": options}

    def remove_instance(self, instance_id: str) -> bool:
        """Stops the instance's subscribers, then forgets its blocks; False if it was unknown."""
        with self._lock:
            entry = self._instances.pop(instance_id, None)
            self._known = tuple(self._instances)
        if entry is None:
            return False
        _stop_all(entry.subscribers)  # joined first, so no batch lands after the clear
        self.index.clear_instance(instance_id)
        self.loads.forget(instance_id)
        return True

    def instances(self) -> list[str]:
        with self._lock:
            return list(self._instances)

    def health(self) -> dict[str, list[Any]]:
        """Per instance, one ``StreamHealth`` per subscriber (one per rank in compatibility mode)."""
        with self._lock:
            entries = list(self._instances.items())
        return {instance: [sub.health() for sub in entry.subscribers] for instance, entry in entries}

    # ------------------------------------------------------------------ queries

    def query(self, token_ids: Sequence[int], lora_name: str | None = None) -> dict[str, dict[int, TierCounts]]:
        """Per followed instance, its ranks' hits (``{}``: followed, nothing cached)."""
        known = self.instances()
        if not known:
            return {}
        found = self.index.query(list(token_ids), lora_name=lora_name, instances=known)
        return {instance: dict(found.get(instance, {})) for instance in known}

    def query_keys(self, keys: Sequence[int]) -> dict[str, dict[int, TierCounts]]:
        """Like :meth:`query`, from chained block keys (``hashing.chain_hashes``)."""
        known = self.instances()
        if not known:
            return {}
        found = self.index.query_keys(list(keys), instances=known)
        return {instance: dict(found.get(instance, {})) for instance in known}

    def hits_for_keys(self, keys: list[int]) -> Mapping[str, Mapping[int, TierCounts]]:
        """:meth:`query_keys` for read-only callers (the HTTP hot path): no copies, and an
        instance with nothing cached is simply absent.  A rank prefilling or queuing the
        prompt's prefix (its stream's rank-load message says so) counts as holding it
        (motor_adapter/pending_hits.py)."""
        known = self._known  # one atomic read of an immutable tuple: no lock on the hot path
        if not known or not keys:
            return {}
        hits = self.index.query_keys(keys, instances=known)
        if self.loads.pending:
            return merge_pending(hits, self.loads, keys, time.monotonic())
        return hits

    def best_for_keys(self, keys: list[int]) -> Mapping[str, tuple[int, TierCounts]] | None:
        """Per followed instance holding block 0, ``(engine rank, hit)`` of its best rank under
        any non-negative weights - when only the NPU tier holds blocks; else ``None`` (fold
        :meth:`hits_for_keys` instead).  The HTTP hot path's one-pass walk."""
        known = self._known
        if not known or not keys:
            return _NO_HITS  # one object: /query remembers its answer
        if self.loads.pending and prompt_pending(self.loads, keys, time.monotonic()):
            return None  # a rank is prefilling its prefix: fold hits_for_keys, which counts it
        return self.index.deepest_npu(keys, known)

    def select(
        self,
        candidates: Sequence[Candidate],
        token_ids: Sequence[int],
        lora_name: str | None = None,
        *,
        role: str = "prefill",
        req_id: str = "-",
    ) -> Decision:
        """Motor's kv_cache_affinity decision for ``token_ids`` among ``candidates``; logged at INFO."""
        decision = self._decide(candidates, token_ids, lora_name)
        if decision_logger.isEnabledFor(logging.INFO):
            decision_logger.info("%s", decision.log_line(role=role, req_id=req_id))
        return decision

    def _decide(self, candidates: Sequence[Candidate], token_ids: Sequence[int], lora_name: str | None) -> Decision:
        problem = _token_problem(token_ids)
        if problem is not None:
            decision = select(self.cfg, candidates, None, 0)
            return dataclasses.replace(decision, reason=problem)
        isl = len(token_ids)
        if isl < self.cfg.block_size:  # Motor's fast path: the index is not asked
            return select(self.cfg, candidates, {}, isl)
        hits: Mapping[str, Mapping[int, TierCounts]] | None = self.query(token_ids, lora_name) or None
        return select(self.cfg, candidates, hits, isl)

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        with self._lock:
            self._closed = True
            ids = list(self._instances)
        for instance_id in ids:
            self.remove_instance(instance_id)

    def __enter__(self) -> KvAffinity:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _token_problem(token_ids: Sequence[int]) -> str | None:
    """Why ``token_ids`` cannot be scored, or None (Motor falls back to load_balance)."""
    if not isinstance(token_ids, Sequence) or isinstance(token_ids, (str, bytes)):
        return "invalid token ids"
    if len(token_ids) == 0:
        return "no token ids"
    try:  # one C-level pass: every id an int in u32 range (the conductor hashes u32)
        array("I", token_ids)
    except (TypeError, OverflowError):
        return "invalid token ids"
    return None


def _stop_all(subscribers: Sequence[_Subscriber]) -> None:
    """Signals every subscriber first, then joins them: N threads wind down together, not one
    poll interval after another (a 256-rank compat registration would otherwise stall)."""
    for sub in subscribers:
        request_stop = getattr(sub, "request_stop", None)  # optional: test doubles may lack it
        if request_stop is not None:
            try:
                request_stop()
            except Exception:
                _log.exception("signalling a stream subscriber to stop failed")
    for sub in subscribers:
        try:
            sub.stop()
        except Exception:  # one stuck stream must not keep the others running
            _log.exception("stopping a stream subscriber failed")
