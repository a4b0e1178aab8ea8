"""``motor-kv-adapter register`` / ``unregister``: send by hand what Motor's coordinator sends.

Motor registers an instance with its conductor once, when it adds the instance (one POST,
2 s timeout, no retry). An adapter that missed it (started later, or ran without a durable
registry) learns the instance from this command instead of a re-add in Motor::

    motor-kv-adapter register --url http://127.0.0.1:13333 --motor-config user_config.json \\
        --ip 10.0.0.5 --instance-id vllm-prefill-0

derives the body the way Motor does (``kv-events-config.endpoint`` with ``*`` replaced by the
instance's IP and the port plus the endpoint id, the same for ``replay_endpoint``; ``type``
always ``vLLM``; ``block_size`` from the engine's ``block-size``); every field can also be
given (or overridden) by a flag. ``--dry-run`` prints the body and sends nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any, Union
from urllib.parse import urlsplit, urlunsplit

__all__ = ["add_parsers", "motor_body"]

_WILDCARDS = ("*", "0.0.0.0", "[::]", "::")
MOTOR_TIMEOUT_S = 2.0  # Motor's register_post timeout


def _endpoint_for(pattern: str, ip: str, endpoint_id: int) -> str:
    """Motor's rule: ``tcp://*:PORT`` -> ``tcp://IP:PORT + endpoint id``."""
    parts = urlsplit(pattern)
    host, _, port = parts.netloc.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"{pattern!r} has no port: expected tcp://*:PORT")
    if host in _WILDCARDS or not host:
        host = f"[{ip}]" if ":" in ip else ip
    return urlunsplit((parts.scheme, f"{host}:{int(port) + endpoint_id}", parts.path, "", ""))


def motor_body(config: Mapping[str, Any], ip: str, instance_id: str, endpoint_id: int = 0) -> dict[str, Any]:
    """The ``/register`` body the released Motor's coordinator builds for one endpoint of an instance.

    As recorded from mindie-motor 3.0.0b2 (docs/examples/register_motor.json): the legacy
    ``endpoint`` key, ``type`` always ``vLLM``, ``block_size`` from the engine's ``block-size``
    (never ``page-size``, never the conductor section), ``modelname`` the instance's model name.
    """
    from motor_adapter.motor_user_config import engine_args, find_engine, kv_events

    engine_key, engine = find_engine(config)
    args = engine_args(engine)
    events, why = kv_events(args)
    if events is None:
        raise ValueError(f"{engine_key}.engine_config.kv-events-config {why}: nothing to subscribe to")
    model_config = engine.get("model_config") if isinstance(engine, Mapping) else None
    model_name = model_config.get("model_name") if isinstance(model_config, Mapping) else None
    body: dict[str, Any] = {
        "endpoint": _endpoint_for(str(events.get("endpoint", "tcp://*:5557")), ip, endpoint_id),
        "type": "vLLM",
        "modelname": str(model_name or args.get("served-model-name") or "default"),
        "block_size": int(args.get("block-size") or 128),
        "instance_id": instance_id,
        "dp_rank": endpoint_id,
    }
    if events.get("replay_endpoint"):
        body["replay_endpoint"] = _endpoint_for(str(events["replay_endpoint"]), ip, endpoint_id)
    return body


def _explicit(args: argparse.Namespace) -> dict[str, Any]:
    """Fields given by flags (they override what --motor-config derives)."""
    out: dict[str, Any] = {}
    if args.endpoint:
        out["medium_endpoints"] = {"npu": args.endpoint}
    for flag, key in (
        ("replay_endpoint", "replay_endpoint"),
        ("model", "modelname"),
        ("block_size", "block_size"),
        ("dp_rank", "dp_rank"),
        ("engine_type", "type"),
        ("store_backend", "store_backend"),
        ("tenant", "tenant_id"),
        ("dp_size", "dp_size"),
    ):
        value = getattr(args, flag)
        if value is not None:
            out[key] = value
    if args.fanned_in:
        out["fanned_in"] = True
    return out


def _register_body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"instance_id": args.instance_id}
    if args.motor_config:
        if not args.ip:
            raise ValueError("--motor-config needs --ip (the instance's address, as Motor fills the endpoint)")
        with open(args.motor_config, encoding="utf-8") as handle:
            config = json.load(handle)
        body = motor_body(config, args.ip, args.instance_id, args.dp_rank or 0)
    elif not args.endpoint:
        raise ValueError("give --endpoint tcp://HOST:PORT (the engine's KV event stream), or --motor-config and --ip")
    else:
        body.update({"dp_rank": 0, "type": "vLLM", "store_backend": "", "modelname": "default", "block_size": 128})
        body["tenant_id"] = "default"
    body.update(_explicit(args))
    return body


def _post(url: str, path: str, body: Mapping[str, Any], token: Union[str, None], timeout: float) -> int:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            print(response.read().decode(errors="replace"))
            return 0
    except urllib.error.HTTPError as exc:
        print(f"motor-kv-adapter: HTTP {exc.code}: {exc.read().decode(errors='replace')}", file=sys.stderr)
    except (urllib.error.URLError, OSError) as exc:
        print(f"motor-kv-adapter: cannot reach {url}: {exc}", file=sys.stderr)
    return 1


def _token(args: argparse.Namespace) -> Union[str, None]:
    from motor_adapter.service import TOKEN_ENV

    return args.token or os.environ.get(TOKEN_ENV) or None


def _register(args: argparse.Namespace) -> int:
    try:
        body = _register_body(args)
    except (OSError, ValueError) as exc:
        print(f"motor-kv-adapter register: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(json.dumps(body, indent=2))
        return 0
    return _post(args.url, "/register", body, _token(args), args.timeout)


def _unregister(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"instance_id": args.instance_id, "tenant_id": args.tenant or "default"}
    if args.dp_rank is not None:
        body["dp_rank"] = args.dp_rank
    if args.model:
        body["modelname"] = args.model
    return _post(args.url, "/unregister", body, _token(args), args.timeout)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="the adapter, e.g. http://127.0.0.1:13333")
    parser.add_argument("--instance-id", required=True, help="Motor's conductor id, e.g. vllm-prefill-0")
    parser.add_argument("--dp-rank", type=int, default=None, help="Motor's endpoint id (default 0)")
    parser.add_argument("--model", default=None, help="served model name (Motor's modelname)")
    parser.add_argument("--tenant", default=None, help="tenant_id (default: default)")
    parser.add_argument("--token", default=None, help="bearer token (default: env MOTOR_KV_ADAPTER_TOKEN)")
    parser.add_argument("--timeout", type=float, default=MOTOR_TIMEOUT_S)


def add_parsers(sub: Any) -> None:
    register = sub.add_parser(
        "register",
        help="send the /register Motor sends when it adds an instance (recovery when the adapter missed it)",
    )
    _common(register)
    register.add_argument("--motor-config", default=None, help="Motor's user_config.json: derive the body from it")
    register.add_argument("--ip", default=None, help="the instance's IP, replacing * in kv-events-config endpoints")
    register.add_argument("--endpoint", default=None, help="the KV event stream, e.g. tcp://10.0.0.5:5557")
    register.add_argument("--replay-endpoint", default=None, help="replay/snapshot, e.g. tcp://10.0.0.5:6667")
    register.add_argument("--block-size", type=int, default=None, help="SGLang's page size (default 128)")
    register.add_argument("--engine-type", default=None, help="registration type (Motor's default: vLLM)")
    register.add_argument("--store-backend", default=None)
    register.add_argument("--fanned-in", action="store_true", help="the engine runs the sglang_kvpub plugin")
    register.add_argument("--dp-size", type=int, default=None, help="the engine's DP ranks behind the endpoint")
    register.add_argument("--dry-run", action="store_true", help="print the body, send nothing")
    register.set_defaults(run=_register)

    unregister = sub.add_parser("unregister", help="send the /unregister Motor sends when it removes an instance")
    _common(unregister)
    unregister.set_defaults(run=_unregister)
