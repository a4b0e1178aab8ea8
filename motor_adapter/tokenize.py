"""Router-side tokenization with the same conventions as Motor's Coordinator and SGLang.

A hit needs the router's token ids to equal what the engine prefills, block for block:
- completions: ``tokenizer.encode(prompt)`` with HF's default ``add_special_tokens=True``
  (what Motor and SGLang do); token-id prompts are used as given; for a list of prompts
  the longest one is used, as Motor does;
- chat: ``apply_chat_template(messages, tools=tools, add_generation_prompt=True,
  tokenize=True)`` - ``tools`` must be passed, or every tool-calling prompt misses.

Tokenizers are loaded from a LOCAL path only (offline).  When the checkpoint names a
vendor tokenizer class that is not importable here (DeepSeek-V4 on a host without vLLM,
the originating report's case), the plain ``tokenizer.json`` is loaded with the generic
fast tokenizer instead, and the fallback is logged.

Imports ``transformers`` lazily: it is the ``motor`` extra.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from motor_adapter.http_contract import RequestError, token_ids_of

__all__ = ["TokenizerError", "Tokenizers", "load_tokenizer", "encode_completion", "encode_chat", "encode_request"]

log = logging.getLogger(__name__)


class TokenizerError(ValueError):
    """The tokenizer cannot be loaded, or a prompt has a shape we cannot encode."""


def _force_offline() -> None:
    # Never reach a model hub from the router: the path must be local.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def load_tokenizer(path: str | os.PathLike[str], trust_remote_code: bool = False) -> Any:
    """A Hugging Face tokenizer from a local directory, with the vendor-class fallback."""
    directory = Path(path)
    if not directory.is_dir():
        raise TokenizerError(f"tokenizer path {str(directory)!r} is not a local directory")
    _force_offline()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception as exc:  # vendor class missing, remote code refused, unknown model_type ...
        fallback = _load_generic_fast(directory)
        if fallback is None:
            raise TokenizerError(f"cannot load tokenizer from {str(directory)!r}: {exc}") from exc
        log.warning(
            "tokenizer at %s: AutoTokenizer failed (%s: %s); loaded tokenizer.json with the generic fast tokenizer",
            directory,
            type(exc).__name__,
            exc,
        )
        return fallback


def _load_generic_fast(directory: Path) -> Any:
    """``tokenizer.json`` + the special tokens and chat template of ``tokenizer_config.json``."""
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        return None
    from transformers import PreTrainedTokenizerFast

    config = _read_json(directory / "tokenizer_config.json")
    kwargs: dict[str, Any] = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = _token_content(config.get(name))
        if value is not None:
            kwargs[name] = value
    for name in ("add_bos_token", "add_eos_token", "model_max_length", "clean_up_tokenization_spaces"):
        if name in config:
            kwargs[name] = config[name]
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), **kwargs)
    template = config.get("chat_template") or _read_text(directory / "chat_template.jinja")
    if template:
        tokenizer.chat_template = template
    return tokenizer


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return None


def _token_content(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _as_ids(value: Any) -> list[int]:
    # transformers 4.x returns a list, 5.x may return a BatchEncoding-like mapping.
    if isinstance(value, Mapping) and "input_ids" in value:
        value = value["input_ids"]
    if hasattr(value, "tolist"):
        value = value.tolist()
    if value and isinstance(value[0], list):  # a batch of one
        value = value[0]
    return [int(t) for t in value]


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def encode_completion(tokenizer: Any, prompt: Any) -> list[int]:
    """Token ids of a ``/v1/completions`` prompt, exactly as Motor computes them.

    ``str`` -> ``encode(prompt)``; ``list[int]`` -> as given; ``list[str]`` and
    ``list[list[int]]`` -> each one encoded, the longest returned.
    """
    if isinstance(prompt, str):
        return _as_ids(tokenizer.encode(prompt))
    if _is_token_ids(prompt):
        return list(prompt)
    if isinstance(prompt, list) and prompt:
        encoded = [
            encode_completion(tokenizer, item) for item in prompt if isinstance(item, str) or _is_token_ids(item)
        ]
        if len(encoded) != len(prompt):
            raise TokenizerError("prompt list must hold only strings or only token-id lists")
        return max(encoded, key=len)
    raise TokenizerError(f"unsupported prompt type {type(prompt).__name__}")


def encode_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None) -> list[int]:
    """Token ids of a ``/v1/chat/completions`` request (chat template, tools, generation prompt)."""
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
        raise TokenizerError("messages must be a list of objects")
    if getattr(tokenizer, "chat_template", None) is None:
        raise TokenizerError("the tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(
        list(messages), tools=list(tools) if tools else None, add_generation_prompt=True, tokenize=True
    )
    return _as_ids(ids)


def encode_request(tokenizer: Any, body: Mapping[str, Any]) -> list[int]:
    """Token ids for a request body carrying ``prompt`` or ``messages`` (+ ``tools``)."""
    if body.get("messages") is not None:
        return encode_chat(tokenizer, body["messages"], body.get("tools"))
    if body.get("prompt") is not None:
        return encode_completion(tokenizer, body["prompt"])
    raise TokenizerError("the body has neither prompt nor messages")


class Tokenizers:
    """Each model's tokenizer (``tokenizers[model]``, else ``default_path``), loaded on first
    use; a request's prompt or messages through it, with the HTTP errors the API names."""

    def __init__(self, tokenizers: Mapping[str, str], default_path: str | None, trust_remote_code: bool) -> None:
        self._paths = tokenizers
        self._default = default_path
        self._trust_remote_code = trust_remote_code
        self._lock = threading.Lock()
        self._loaded: dict[str, Any] = {}

    def for_model(self, model: str) -> Any:
        path = self._paths.get(model) or self._default
        if not path:
            raise RequestError(
                400, "no_tokenizer", "prompt/messages need a tokenizer: set tokenizer_path (or tokenizers) in --config"
            )
        with self._lock:
            tok = self._loaded.get(path)
        if tok is None:
            try:
                tok = load_tokenizer(path, trust_remote_code=self._trust_remote_code)
            except TokenizerError as exc:
                raise RequestError(500, "tokenizer_unavailable", str(exc)) from exc
            with self._lock:
                self._loaded[path] = tok
        return tok

    def tokens_of(self, model: str, body: Mapping[str, Any]) -> list[int]:
        """``token_ids`` as given, else ``prompt``/``messages`` through the model's tokenizer."""
        if body.get("token_ids") is not None:
            return token_ids_of(body["token_ids"])
        if body.get("prompt") is None and body.get("messages") is None:
            raise RequestError(400, "bad_field", "the body needs token_ids, prompt or messages")
        tok = self.for_model(model)
        try:
            return encode_request(tok, body)
        except TokenizerError as exc:
            raise RequestError(400, "bad_prompt", str(exc)) from exc
        except Exception as exc:  # a chat template may raise anything on odd input
            raise RequestError(400, "bad_prompt", f"{type(exc).__name__}: {exc}") from exc
