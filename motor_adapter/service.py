"""A kv-conductor-compatible HTTP service: Motor enables affinity by configuration alone.

Point Motor at it: ``KV_CONDUCTOR_SERVICE`` in the coordinator's environment (the host) and
``kv_conductor_config.http_server_port`` (the port).
Endpoints (``motor-conductor.md`` section 4): ``POST /register``, ``/unregister``,
``/query`` (JSON or msgpack body), ``/query_by_hash``; ``GET /workers``, ``/health``,
``/metrics``, ``/ready`` (readiness, :mod:`motor_adapter.readiness`); ours: ``POST /select``
(Motor's decision + log line) and ``/explain``.

State: one :class:`~motor_adapter.affinity.KvAffinity` (one prefix index) per
``(model, tenant, block_size)``; one subscription per distinct stream URL in it, shared by
every registration naming that URL. ``/query`` lists every registered dp of the model,
zeros included (conductor semantics), with a fanned-in instance's engine ranks folded
into its registered dp and ``engine_dp_rank`` naming the rank that holds the prefix.

Request bodies are bounded, decoded with msgspec (JSON or msgpack, never pickle), and a
bad one gets a 4xx JSON ``{"error", "detail"}`` and is counted.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
from aiohttp import hdrs, web

from motor_adapter import metrics
from motor_adapter.adapter_metrics import LABELS_MAX, query_memo_text
from motor_adapter.affinity import decision_logger
from motor_adapter.conductor_v31 import blocks_answer, by_hash_units, indexer_summary
from motor_adapter.http_contract import (
    I64_MIN,
    MSGPACK_TYPES,
    U64_MASK,
    QueryBody,
    RequestError,
    candidates_of,
    field_block_size,
    field_str,
    token_ids_of,
    u32_tokens,
)
from motor_adapter.http_events import EventsIngest
from motor_adapter.http_query import QueryReader, encoded_answer, parse, wants_msgpack
from motor_adapter.readiness import readiness
from motor_adapter.registration import (
    DEFAULT_TENANT,
    MOTOR_REGISTER_TIMEOUT_S,
    RegistrationError,
    parse_registration,
    parse_unregistration,
)
from motor_adapter.registry.durable import DurableRegistrations
from motor_adapter.registry.spec import open_store
from motor_adapter.settings import MAX_STREAMS_ENV, TOKEN_ENV, ServiceConfig
from motor_adapter.state import AdapterState, AffinityFactory
from sglang_kvpub.core.ratelimit import RateLimiter

__all__ = [
    "ServiceConfig",
    "AdapterState",
    "RequestError",
    "build_app",
    "run_server",
    "AffinityFactory",
    "TOKEN_ENV",
    "MAX_STREAMS_ENV",
    "QueryBody",
    "token_ids_of",
    "u32_tokens",
]

log = logging.getLogger(__name__)

_MSGPACK_HEADERS = frozenset(MSGPACK_TYPES)
_ENCODER = msgspec.json.Encoder()
_MSGPACK_ENCODER = msgspec.msgpack.Encoder()


def _json_response(data: Any) -> web.Response:
    return web.Response(body=_ENCODER.encode(data), content_type="application/json")


def _answer(request: web.Request, data: Any) -> web.Response:
    """A query answer: msgpack when the client's Accept names a msgpack type, else JSON."""
    if wants_msgpack(request):
        return web.Response(body=_MSGPACK_ENCODER.encode(data), content_type=MSGPACK_TYPES[0])
    return _json_response(data)


def _error(status: int, reason: str, detail: str) -> web.Response:
    return web.json_response({"error": reason, "detail": detail}, status=status)


class _Handlers:
    def __init__(self, state: AdapterState, registry: DurableRegistrations) -> None:
        self.state = state
        self.registry = registry
        self.config = state.config
        self._json = msgspec.json.Decoder()
        self._msgpack = msgspec.msgpack.Decoder()
        self._query_json = msgspec.json.Decoder(QueryBody)
        self._query_msgpack = msgspec.msgpack.Decoder(QueryBody)
        self._query = QueryReader(state.tokenizers.tokens_of)
        self._register_lock = registry.lock  # restores and other replicas' changes take it too
        self._events = EventsIngest(state)

    async def body(self, request: web.Request) -> dict[str, Any]:
        data = await self._decode(request, self._msgpack, self._json)
        if not isinstance(data, dict):
            raise RequestError(400, "bad_body", f"the body must be an object, got {type(data).__name__}")
        return data

    async def query_body(self, request: web.Request) -> QueryBody:
        body: QueryBody = await self._decode(request, self._query_msgpack, self._query_json)
        return body

    async def _decode(self, request: web.Request, msgpack_decoder: Any, json_decoder: Any) -> Any:
        raw, is_msgpack = await self._raw(request)
        return parse(raw, is_msgpack, msgpack_decoder, json_decoder)

    async def _raw(self, request: web.Request) -> tuple[bytes, bool]:
        """The body (bounded) and whether it is msgpack.  No check of the declared
        ``Content-Length`` ahead of the read (a cost on every query for no gain): aiohttp's
        ``client_max_size`` (the limit + 1) stops a larger body during the read."""
        limit = self.config.max_body_bytes
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise RequestError(413, "body_too_large", f"body larger than {limit} bytes") from exc
        if len(raw) > limit:
            raise RequestError(413, "body_too_large", f"{len(raw)} bytes > limit {limit}")
        given = request.headers.get(hdrs.CONTENT_TYPE)
        if given in _MSGPACK_HEADERS:  # the common exact header: no parse of its parameters
            return raw, True
        return raw, request.content_type in MSGPACK_TYPES

    def authorize(self, request: web.Request) -> None:
        token = self.config.auth_token
        if not token:
            return
        given = request.headers.get(hdrs.AUTHORIZATION, "")
        if not (given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), token.encode())):
            raise RequestError(401, "unauthorized", "this endpoint needs Authorization: Bearer <token>")

    async def register(self, request: web.Request) -> web.Response:
        self.authorize(request)
        body = await self.body(request)
        try:
            reg = parse_registration(body)
        except RegistrationError as exc:
            raise RequestError(400, "bad_registration", str(exc)) from exc
        started = time.monotonic()
        async with self._register_lock:  # starting/stopping subscribers joins threads: off the loop
            result = await asyncio.to_thread(self.state.register, reg)
            result = await self.registry.registered(body, reg, result)  # write-through, bounded wait
        took = time.monotonic() - started
        if took > MOTOR_REGISTER_TIMEOUT_S:
            # Motor timed out on this answer and never sends it again: its log says failed, ours why.
            log.warning(
                "/register of %s dp %d took %.1f s, past Motor's %.0f s timeout: Motor gave up on the answer "
                "and does not send it again, but it is registered here (GET /workers lists it); if this repeats, "
                "look at what held the adapter (a registry write, many subscribers starting at once, a busy host)",
                reg.instance_id,
                reg.dp_rank,
                took,
                MOTOR_REGISTER_TIMEOUT_S,
            )
        return web.json_response(result)

    async def unregister(self, request: web.Request) -> web.Response:
        self.authorize(request)
        body = await self.body(request)
        try:
            unreg = parse_unregistration(body)
        except RegistrationError as exc:
            raise RequestError(400, "bad_registration", str(exc)) from exc
        async with self._register_lock:
            removed = await asyncio.to_thread(self.state.unregister, unreg)
            removed += await self.registry.unregistered(unreg)  # write-through (and unrestorable records)
        if not removed:
            raise RequestError(404, "InstanceNotFound", f"{unreg.instance_id} dp {unreg.dp_rank} is not registered")
        return web.json_response({"status": "ok", "removed": removed})

    def _common(self, body: Mapping[str, Any]) -> tuple[str, str, int]:
        model = field_str(body, "model")
        tenant = body.get("tenant_id") or DEFAULT_TENANT
        if not isinstance(tenant, str):
            raise RequestError(400, "bad_field", "tenant_id must be a string")
        return model, tenant, field_block_size(body, 128)

    async def _tokens(self, model: str, body: Mapping[str, Any]) -> list[int]:
        if body.get("token_ids") is not None:
            return token_ids_of(body["token_ids"])
        return await asyncio.to_thread(self.state.tokenizers.tokens_of, model, body)  # tokenizers are slow

    async def query(self, request: web.Request) -> web.Response:
        raw, is_msgpack = await self._raw(request)
        started = time.perf_counter()
        p = self._query.hashed(raw, is_msgpack)
        if p is None:
            p = await self._query.prompt(raw, is_msgpack)
        answer = self.state.answer_keys(p.model, p.tenant, p.block_size, p.keys, p.blocks, started, p.isl, p.spread)
        return encoded_answer(request, answer)

    async def query_by_hash(self, request: web.Request) -> web.Response:
        body = await self.query_body(request)
        model, tenant, block_size = body.common()
        if body.block_hashes is None:
            raise RequestError(400, "bad_field", "block_hashes (a list of 64-bit local block hashes) is required")
        if any(not I64_MIN <= h <= U64_MASK for h in body.block_hashes):
            raise RequestError(400, "bad_field", "block_hashes must hold 64-bit integers (u64, or i64)")
        hashes = [h & U64_MASK for h in body.block_hashes]
        if by_hash_units(body.units, self.config.query_by_hash_units) == "blocks":  # Motor 3.1's units
            return _answer(request, blocks_answer(self.state, model, tenant, block_size, hashes))
        return _answer(request, self.state.query_by_hash(model, tenant, block_size, hashes))

    async def select(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        model, tenant, _ = self._common(body)
        block_size = field_block_size(body, self.config.kv_affinity.block_size)
        candidates = candidates_of(body.get("candidates"))
        tokens = await self._tokens(model, body)
        decision = self.state.select(model, tenant, block_size, candidates, tokens)
        line = decision.log_line(role=str(body.get("role", "prefill")), req_id=str(body.get("req_id", "-")))
        decision_logger.info("%s", line)
        return web.json_response({**decision.to_dict(), "log_line": line})

    async def explain(self, request: web.Request) -> web.Response:
        from motor_adapter.explain import explain

        body = await self.body(request)
        model, tenant, block_size = self._common(body)
        tokens: list[int] | None = None
        tokenizer_error: str | None = None
        try:
            tokens = await self._tokens(model, body)
        except RequestError as exc:
            if body.get("token_ids") is not None:
                raise
            tokenizer_error = exc.detail
        bos = body.get("bos_token_id")
        if not isinstance(bos, int) or isinstance(bos, bool):
            bos = None
        if bos is None and body.get("token_ids") is None and tokens is not None:
            bos = getattr(self.state.tokenizers.for_model(model), "bos_token_id", None)
        report = await asyncio.to_thread(
            explain,
            self.state,
            model,
            tenant,
            block_size,
            tokens or [],
            tokenizer_error=tokenizer_error,
            bos_token_id=bos,
        )
        return web.json_response(report)

    async def workers(self, request: web.Request) -> web.Response:
        return web.json_response({**self.state.workers(), "indexer": indexer_summary(self.state)})

    async def events(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        return _answer(request, await asyncio.to_thread(self._events.apply, body))

    async def registry_status(self, request: web.Request) -> web.Response:
        return web.json_response(self.registry.status())

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")  # liveness only; /ready says whether the answers are complete

    async def ready(self, request: web.Request) -> web.Response:
        restored = self.registry.restore_done is not None
        found = readiness(self.registry.status(), restored, self.state.stream_health())
        return web.json_response(found.body(), status=200 if found.ready else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        text = self.state.render_metrics() + self.registry.render_metrics() + query_memo_text(self._query.memo)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")


_UNLIMITED_PATHS = frozenset({"/health", "/ready", "/metrics"})


def _rate_limit(config: ServiceConfig) -> list[Any]:
    """Refuses a client IP over its token bucket with 429 (counted by ``errors``); no middleware
    at all when no rate is set (one layer less on every request)."""
    if not config.rate_limit_rps:
        return []
    limiter = RateLimiter(config.rate_limit_rps, config.rate_limit_burst)

    @web.middleware
    async def limit(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        path_limited = request.path not in _UNLIMITED_PATHS
        if path_limited and not limiter.allow(request.remote or "-", time.monotonic()):
            raise RequestError(429, "rate_limited", f"over {config.rate_limit_rps:g} requests/s per client")
        response: web.StreamResponse = await handler(request)
        return response

    return [limit]


_REQUEST_LABELS: dict[tuple[str, int], metrics.Labels] = {}


def _request_labels(path: str, status: int) -> metrics.Labels:
    """``requests``' label set, built once per (route, status): paths are routes, so few."""
    labels = _REQUEST_LABELS.get((path, status))
    if labels is None:
        if len(_REQUEST_LABELS) >= LABELS_MAX:
            _REQUEST_LABELS.clear()
        labels = _REQUEST_LABELS[(path, status)] = (("path", path), ("status", str(status)))
    return labels


def build_app(state: AdapterState, registry: DurableRegistrations | None = None) -> web.Application:
    """The HTTP app; ``registry`` defaults to the store ``state.config.registry`` names (memory when unset).

    Raises :class:`~motor_adapter.registry.store.RegistryError` for a registry spec it cannot use.
    """
    if registry is None:
        store = open_store(state.config.registry or "memory")
        registry = DurableRegistrations(state, store, dead_after_s=state.config.registry_dead_after_s)
    handlers = _Handlers(state, registry)
    metric = state.metrics

    @web.middleware
    async def errors(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        path = request.match_info.route.resource.canonical if request.match_info.route.resource else "unknown"
        try:
            response: web.StreamResponse = await handler(request)
        except RequestError as exc:
            metric.bad_requests.inc(path=path, reason=exc.reason)
            log.info("%s %s refused: %s", request.method, path, exc)
            response = _error(exc.status, exc.reason, exc.detail)
        except web.HTTPException as exc:  # 404/405 from routing
            metric.bad_requests.inc(path=path, reason=f"http_{exc.status}")
            response = _error(exc.status, exc.reason or "error", exc.text or "")
        except Exception as exc:  # a bug, not the client's fault: answer JSON, count it, keep serving
            metric.bad_requests.inc(path=path, reason="internal_error")
            log.exception("%s %s failed", request.method, path)
            response = _error(500, "internal_error", f"{type(exc).__name__} (see the adapter's log)")
        metric.requests.inc_labels(_request_labels(path, response.status))
        return response

    # aiohttp enforces the limit too (chunked bodies); ours gives the JSON message.
    app = web.Application(
        middlewares=[errors, *_rate_limit(state.config)], client_max_size=state.config.max_body_bytes + 1
    )
    app.router.add_post("/register", handlers.register)
    app.router.add_post("/unregister", handlers.unregister)
    app.router.add_post("/query", handlers.query)
    app.router.add_post("/query_by_hash", handlers.query_by_hash)
    app.router.add_post("/events", handlers.events)
    app.router.add_post("/select", handlers.select)
    app.router.add_post("/explain", handlers.explain)
    app.router.add_get("/workers", handlers.workers)
    app.router.add_get("/registry", handlers.registry_status)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/ready", handlers.ready)
    app.router.add_get("/metrics", handlers.metrics)

    async def start_registry(app: web.Application) -> None:
        await registry.start()  # a bad state file fails the start here, before the port opens

    async def close_registry(app: web.Application) -> None:
        await registry.close()  # before the state closes: closing forgets nothing in the store

    async def close_state(app: web.Application) -> None:
        await asyncio.to_thread(state.close)

    app.on_startup.append(start_registry)
    app.on_shutdown.append(close_registry)
    app.on_cleanup.append(close_state)
    return app


def run_server(config: ServiceConfig) -> None:
    """Serves until interrupted (``motor-kv-adapter serve``)."""
    state = AdapterState(config)
    web.run_app(build_app(state), host=config.host, port=config.port, access_log=None, print=None)
