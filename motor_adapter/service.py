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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import msgspec
from aiohttp import hdrs, web
from xxhash import xxh3_128_intdigest as _xxh3_128

from motor_adapter import metrics, native
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
    take_query_keys,
    take_token_ids,
    token_ids_of,
    u32_tokens,
)
from motor_adapter.http_events import EventsIngest
from motor_adapter.readiness import readiness
from motor_adapter.registration import (
    DEFAULT_TENANT,
    RegistrationError,
    parse_registration,
    parse_unregistration,
)
from motor_adapter.registry.durable import DurableRegistrations
from motor_adapter.registry.spec import open_store
from motor_adapter.settings import MAX_STREAMS_ENV, TOKEN_ENV, ServiceConfig
from motor_adapter.state import AdapterState, AffinityFactory, Answer
from sglang_kvpub.core import hashing
from sglang_kvpub.core.hashing import sequence_keys
from sglang_kvpub.core.rank_cost import spread_key
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
# /query bodies' fields apart from the ids, decoded, by their bytes: clients send the same
# model, block size and tenant again and again (a few combinations, each a few dozen bytes)
_QUERY_FIELDS_MAX = 256
_QUERY_FIELDS_BYTES = 512  # a longer rest (a prompt text beside the ids, say) is decoded each time


def _body_key_py(raw: bytes, is_msgpack: bool) -> int:
    return (_xxh3_128(raw) << 1) | is_msgpack


# The prompt cache's key in C when built: the xxhash package's own function dispatches to
# AVX-512 on CPUs that have it, which cost the live server ~2 us more CPU per 30 KB body than
# the same hash on SSE2, though faster in a tight loop (docs/native.md, body_key; issue 32).
_body_key: Callable[[bytes, bool], int] = native.MODULE.body_key if native.MODULE else _body_key_py


def _json_response(data: Any) -> web.Response:
    return web.Response(body=_ENCODER.encode(data), content_type="application/json")


def _wants_msgpack(request: web.Request) -> bool:
    """msgpack when the client's Accept names it (Motor 3.1's client does, and reads the answer
    by its Content-Type); else JSON, which every Motor reads."""
    accept = request.headers.get(hdrs.ACCEPT)  # aiohttp's case-folded name: no fold per lookup
    return bool(accept and "msgpack" in accept and any(kind in accept for kind in MSGPACK_TYPES))


def _answer(request: web.Request, data: Any) -> web.Response:
    """A query answer: msgpack when the client's Accept names a msgpack type, else JSON."""
    if _wants_msgpack(request):
        return web.Response(body=_MSGPACK_ENCODER.encode(data), content_type=MSGPACK_TYPES[0])
    return _json_response(data)


def _encoded_answer(request: web.Request, answer: Answer) -> web.Response:
    """:func:`_answer` of a remembered answer: each format encoded once per answer."""
    kind = MSGPACK_TYPES[0] if _wants_msgpack(request) else "application/json"
    body = answer.encoded.get(kind)
    if body is None:
        encoder = _MSGPACK_ENCODER if kind != "application/json" else _ENCODER
        body = answer.encoded[kind] = encoder.encode(answer.body)
    return web.Response(body=body, content_type=kind)


class _Prompt(msgspec.Struct, frozen=True, gc=False):
    """What a ``/query`` body asks, hashed: the part of a query that depends on the body alone.
    A struct (made in 0.14 us, where a frozen dataclass took 1.7: one per new body); no
    cycle can run through its strs, ints and list of ints, so the collector need not track it."""

    model: str
    tenant: str
    block_size: int
    keys: list[int]  # shared by every hit of the cache: never mutated
    blocks: int
    isl: Union[int, None] = None  # prompt tokens (None: the full blocks')
    spread: int = 0  # the tie-break key (rank_cost.spread_key): the dispatcher computes the same


class _PromptCache:
    """Hashed ``/query`` bodies by their exact bytes: a prompt sent again (a retry, a repeated
    prompt, several routers asking for the same request) skips decoding, tokenizing and
    hashing.  For the bodies the C path does not take (JSON, text to tokenize, no C helpers):
    a msgpack body of token ids sent again is recognised by the handler's ``QueryKeysMemo``
    instead, which compares it with the body it remembers and hashes only its first KiB.
    Keyed by XXH3-128 of the body, confirmed by comparing the stored body (a
    collision is a miss, never a wrong answer). Bounded in entries and bytes, least recently
    used first out. A body is kept from its second sight on: the first only leaves a mark of
    its digest (a doorkeeper: a byte per slot of a fixed table, slot and tag taken from the
    digest; a later body on the same slot overwrites the mark, and a tag shared by chance
    keeps a body at its first sight - harmless), so one-off prompts neither pay for keeping a
    copy nor push out the prompts that recur, and a stream of new prompts allocates nothing
    here. Only touched from the event loop thread."""

    def __init__(self, max_entries: int = 1024, max_bytes: int = 32 << 20, max_seen: int = 8192) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_seen = max_seen
        self._entries: dict[int, tuple[bytes, _Prompt]] = {}
        self._bytes = 0
        self._newest = -1  # the key last put or moved to the end of _entries (keys are >= 0)
        slots = 1 << max(1, (max_seen - 1).bit_length())  # a power of two, at least max_seen
        self._seen = bytearray(slots)  # per slot, the tag of the digest last seen once there (0: none)
        self._seen_mask = slots - 1

    @staticmethod
    def key(raw: bytes, is_msgpack: bool) -> int:
        """The body's XXH3-128 and its format in one int: no tuple per body (the cache keeps
        up to a thousand keys, and tuples are objects every full garbage collection walks).
        In C when built (``body_key``: the same value, hashed without AVX-512)."""
        return _body_key(raw, is_msgpack)

    def get(self, key: int, raw: bytes) -> _Prompt | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if key != self._newest:  # a prompt sent again and again is already the most recent
            del self._entries[key]
            self._entries[key] = entry  # most recent last
            self._newest = key
        return entry[1] if entry[0] == raw else None

    def put(self, key: int, raw: bytes, prompt: _Prompt) -> None:
        if key not in self._entries and not self._admit(key):
            return  # first sight (the common case for new prompts): a mark, nothing else
        size = _entry_bytes(raw, prompt)
        if size > self.max_bytes // 8:
            return  # one huge body must not flush the cache
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= _entry_bytes(*old)
        self._entries[key] = (raw, prompt)
        self._newest = key
        self._bytes += size
        while self._bytes > self.max_bytes or len(self._entries) > self.max_entries:
            oldest = next(iter(self._entries))
            self._bytes -= _entry_bytes(*self._entries.pop(oldest))

    def _admit(self, key: int) -> bool:
        """Whether a body not kept yet was seen before; else its digest's mark is left."""
        slot = (key >> 1) & self._seen_mask  # bit 0 is the format
        tag = ((key >> 64) & 0xFF) | 1  # from other bits than the slot's; never 0 (empty)
        if self._seen[slot] == tag:
            self._seen[slot] = 0
            return True
        self._seen[slot] = tag
        return False


def _entry_bytes(raw: bytes, prompt: _Prompt) -> int:
    return len(raw) + 8 * len(prompt.keys)


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
        self._native = native.MODULE  # /query's msgpack ids go straight to u32 in C when built
        # recent /query bodies, for the leading blocks the next turn of a conversation (or a shared
        # system prompt) repeats byte for byte; only touched from the event loop thread, like _prompts
        self._query_memo = self._native.QueryKeysMemo() if self._native else None
        self._prompts = _PromptCache()
        self._query_fields: dict[bytes, tuple[str, str, int]] = {}  # msgpack rest -> (model, tenant, block size)
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
        return self._parse(raw, is_msgpack, msgpack_decoder, json_decoder)

    async def _raw(self, request: web.Request) -> tuple[bytes, bool]:
        """The body (bounded) and whether it is msgpack.  No check of the declared
        ``Content-Length`` ahead of the read (it cost every query ~1 us): aiohttp's
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

    @staticmethod
    def _parse(raw: bytes, is_msgpack: bool, msgpack_decoder: Any, json_decoder: Any) -> Any:
        try:
            return msgpack_decoder.decode(raw) if is_msgpack else json_decoder.decode(raw)
        except msgspec.ValidationError as exc:  # well-formed, wrong shape: name the field
            reason = "bad_field" if "at `$." in str(exc) else "bad_body"
            raise RequestError(400, reason, str(exc)) from exc
        except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested too deep for Any fields
            kind = "msgpack" if is_msgpack else "JSON"
            raise RequestError(400, f"invalid_{kind.lower()}", f"the body is not valid {kind}: {exc}") from exc

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
        async with self._register_lock:  # starting/stopping subscribers joins threads: off the loop
            result = await asyncio.to_thread(self.state.register, reg)
            result = await self.registry.registered(body, reg, result)  # write-through, bounded wait
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
        memo = self._query_memo
        prompt: _Prompt | None = None
        # msgpack token ids in one C call (decoded and hashed, or the same bytes' prompt from
        # the memo: no hash of the whole body); any other body through the prompt cache
        if is_msgpack and memo is not None:
            split = take_query_keys(raw, self._native, hashing.BASE_SEED, memo)
            if type(split) is _Prompt:  # these exact bytes were answered before: their prompt
                prompt = split
            elif type(split) is tuple:
                rest, keys, count, spread, size = split
                stated = self._query_fields.get(rest)
                if stated is None:  # decoded and checked once per distinct rest (an error raises: never kept)
                    body: QueryBody = self._parse(rest, is_msgpack, self._query_msgpack, self._query_json)
                    stated = body.common()
                    if len(rest) <= _QUERY_FIELDS_BYTES:
                        if len(self._query_fields) >= _QUERY_FIELDS_MAX:
                            self._query_fields.clear()
                        self._query_fields[rest] = stated
                model, tenant, block_size = stated
                if block_size == size:  # C read the block size the decoder read (else the path below)
                    prompt = _Prompt(model, tenant, size, keys, count // size, count, spread)
                    memo.attach(raw, prompt)  # for the same bytes again (a remembered body only)
        if prompt is None:  # JSON, text to tokenize, no C helpers
            cache_key = self._prompts.key(raw, is_msgpack)
            prompt = self._prompts.get(cache_key, raw)
        if prompt is None:
            taken, rest = take_token_ids(raw, self._native) if is_msgpack and self._native else (None, raw)
            body = self._parse(rest, is_msgpack, self._query_msgpack, self._query_json)
            model, tenant, block_size = body.common()
            ids: Sequence[int] | None = body.token_ids if taken is None else memoryview(taken).cast("I")
            if ids is None:
                fields = {"prompt": body.prompt, "messages": body.messages, "tools": body.tools}
                ids = await asyncio.to_thread(self.state.tokenizers.tokens_of, model, fields)
            tokens = ids if type(ids) is memoryview else u32_tokens(ids)
            keys = sequence_keys(tokens, block_size)
            spread = spread_key(tokens, block_size)
            prompt = _Prompt(model, tenant, block_size, keys, len(tokens) // block_size, len(tokens), spread)
            self._prompts.put(cache_key, raw, prompt)
        p = prompt
        answer = self.state.answer_keys(p.model, p.tenant, p.block_size, p.keys, p.blocks, started, p.isl, p.spread)
        return _encoded_answer(request, answer)

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
        text = self.state.render_metrics() + self.registry.render_metrics() + query_memo_text(self._query_memo)
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
