"""``POST /query``'s HTTP part: the body read into a :class:`Prompt`, the answer encoded.

A msgpack body of token ids (Motor's) goes through the router's C helpers in one call
(:meth:`QueryReader.hashed`, ``take_query_keys``: ids split off, range-checked and hashed
into block keys; the leading blocks a recent body shares byte for byte, and a body sent again
whole, come from the handler's ``QueryKeysMemo`` instead, docs/native.md).  Any other body -
JSON, a prompt or messages to tokenize, a build without the helpers - is decoded by msgspec,
tokenized off the event loop when it needs the tokenizer, and hashed
(:meth:`QueryReader.prompt`).  The answer itself is
:meth:`motor_adapter.state.AdapterState.answer_keys` (:mod:`motor_adapter.query`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import msgspec
from aiohttp import hdrs, web

from motor_adapter import native
from motor_adapter.answer import JSON_TYPE, Answer
from motor_adapter.http_contract import (
    MSGPACK_TYPES,
    QueryBody,
    RequestError,
    take_query_keys,
    take_token_ids,
    u32_tokens,
)
from sglang_kvpub.core import hashing
from sglang_kvpub.core.hashing import sequence_keys
from sglang_kvpub.core.rank_cost import spread_key

__all__ = ["Prompt", "QueryReader", "encoded_answer", "parse", "wants_msgpack"]

_JSON_ENCODER = msgspec.json.Encoder()
_MSGPACK_ENCODER = msgspec.msgpack.Encoder()
TokensOf = Callable[[str, Mapping[str, Any]], list[int]]  # (model, prompt fields) -> token ids


class Prompt(msgspec.Struct, frozen=True, gc=False):
    """What a ``/query`` body asks, hashed: the part of a query that depends on the body alone.
    No cycle can run through its strs, ints and list of ints: the collector need not track it."""

    model: str
    tenant: str
    block_size: int
    keys: list[int]  # shared by every answer to the same bytes: never mutated
    blocks: int
    isl: int  # prompt tokens
    spread: int = 0  # the tie-break key (rank_cost.spread_key): the dispatcher computes the same


def parse(raw: bytes, is_msgpack: bool, msgpack_decoder: Any, json_decoder: Any) -> Any:
    """``raw`` decoded; a 400 naming the field or the format when it is not what is expected."""
    try:
        return msgpack_decoder.decode(raw) if is_msgpack else json_decoder.decode(raw)
    except msgspec.ValidationError as exc:  # well-formed, wrong shape: name the field
        reason = "bad_field" if "at `$." in str(exc) else "bad_body"
        raise RequestError(400, reason, str(exc)) from exc
    except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested too deep for Any fields
        kind = "msgpack" if is_msgpack else "JSON"
        raise RequestError(400, f"invalid_{kind.lower()}", f"the body is not valid {kind}: {exc}") from exc


class QueryReader:
    """A ``/query`` body to its :class:`Prompt`.  Only touched from the event loop thread."""

    def __init__(self, tokens_of: TokensOf) -> None:
        self._tokens_of = tokens_of
        self._msgpack = msgspec.msgpack.Decoder(QueryBody)
        self._json = msgspec.json.Decoder(QueryBody)
        self._native = native.MODULE  # None: the Python path reads every body
        # Recent bodies, for the leading blocks the next turn of a conversation (or a shared
        # system prompt) repeats byte for byte, and for a body sent again whole.
        self.memo = self._native.QueryKeysMemo() if self._native else None

    def hashed(self, raw: bytes, is_msgpack: bool) -> Union[Prompt, None]:
        """The prompt of a msgpack body of token ids, read by the C helpers in one call (no
        coroutine: every Motor query takes this path); None when :meth:`prompt` must read it."""
        memo = self.memo
        if not is_msgpack or memo is None:
            return None
        split = take_query_keys(raw, self._native, hashing.BASE_SEED, memo)
        if type(split) is Prompt:  # these exact bytes were read before: their prompt
            return split
        if type(split) is tuple:
            rest, keys, count, spread, size = split
            model, tenant, block_size = parse(rest, True, self._msgpack, self._json).common()
            if block_size == size:  # C read the block size the decoder read (else the path below)
                prompt = Prompt(model, tenant, size, keys, count // size, count, spread)
                memo.attach(raw, prompt)  # for the same bytes again (a remembered body only)
                return prompt
        return None

    async def prompt(self, raw: bytes, is_msgpack: bool) -> Prompt:
        """Any body's prompt: JSON, a prompt or messages to tokenize (off the event loop), a
        build without the C helpers, or a msgpack body :meth:`hashed` did not read."""
        taken, rest = take_token_ids(raw, self._native) if is_msgpack and self._native else (None, raw)
        body = parse(rest, is_msgpack, self._msgpack, self._json)
        model, tenant, block_size = body.common()
        ids: Union[Sequence[int], None] = body.token_ids if taken is None else memoryview(taken).cast("I")
        if ids is None:
            fields = {"prompt": body.prompt, "messages": body.messages, "tools": body.tools}
            ids = await asyncio.to_thread(self._tokens_of, model, fields)  # tokenizers are slow
        tokens = ids if type(ids) is memoryview else u32_tokens(ids)
        keys = sequence_keys(tokens, block_size)
        spread = spread_key(tokens, block_size)
        return Prompt(model, tenant, block_size, keys, len(tokens) // block_size, len(tokens), spread)


def wants_msgpack(request: web.Request) -> bool:
    """msgpack when the client's Accept names it (Motor 3.1's client does, and reads the answer
    by its Content-Type); else JSON, which every Motor reads."""
    accept = request.headers.get(hdrs.ACCEPT)  # aiohttp's case-folded name: no fold per lookup
    return bool(accept and "msgpack" in accept and any(kind in accept for kind in MSGPACK_TYPES))


def encoded_answer(request: web.Request, answer: Answer) -> web.Response:
    """An answer in the format the client asks for, each format encoded once per answer."""
    kind = MSGPACK_TYPES[0] if wants_msgpack(request) else JSON_TYPE
    body = answer.encoded.get(kind)
    if body is None:
        encoder = _MSGPACK_ENCODER if kind != JSON_TYPE else _JSON_ENCODER
        body = answer.encoded[kind] = encoder.encode(answer.body)
    return web.Response(body=body, content_type=kind)
