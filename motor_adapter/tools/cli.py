"""``motor-kv-adapter``: serve the conductor-compatible API, check a Motor config, explain a miss."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

__all__ = ["main", "build_parser", "serve_config"]


def _serve(args: argparse.Namespace) -> int:
    return serve_config(
        args.config, host=args.host, port=args.port, tokenizer=args.tokenizer, registry=args.registry, origin=None
    )


def serve_config(
    path: str | None,
    *,
    host: str | None,
    port: int | None,
    tokenizer: str | None,
    registry: str | None,
    origin: str | None,
) -> int:
    """Serves with the config at ``path`` (None: defaults) and the given overrides; 2 for a bad
    config (named with ``origin``, or as ``--config``) or registry, before the port opens."""
    from motor_adapter.registry.store import RegistryError, default_registry_spec
    from motor_adapter.scoring import ConfigError
    from motor_adapter.service import ServiceConfig, run_server

    name = origin or "motor-kv-adapter: bad --config"
    try:
        config = ServiceConfig.from_file(path) if path else ServiceConfig.from_mapping({})
    except (OSError, ValueError, ConfigError) as exc:
        print(f"{name}: {exc}", file=sys.stderr, flush=True)
        return 2
    overrides: dict[str, Any] = {}
    if host is not None:
        overrides["host"] = host
    if port is not None:
        overrides["port"] = port
    if tokenizer is not None:
        overrides["tokenizer_path"] = tokenizer
    # --registry, else the config's "registry", else MOTOR_KV_ADAPTER_REGISTRY, else a file per port
    overrides["registry"] = registry = registry or config.registry or default_registry_spec(port or config.port)
    import dataclasses

    config = dataclasses.replace(config, **overrides)
    logging.getLogger(__name__).info("serving on http://%s:%d, registry %s", config.host, config.port, registry)
    print(
        f"motor-kv-adapter serving on http://{config.host}:{config.port} (registry {registry})",
        file=sys.stderr,
        flush=True,
    )
    try:
        run_server(config)
    except RegistryError as exc:
        print(f"motor-kv-adapter: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


def _check_config(args: argparse.Namespace) -> int:
    from motor_adapter.config_check import check_config, load_config_file

    try:
        config = load_config_file(args.file)
    except (OSError, ValueError) as exc:
        print(f"{args.file}: cannot read a JSON config: {exc}")
        return 1
    engine_env = None
    if args.env_config:
        try:
            engine_env = load_config_file(args.env_config)
        except (OSError, ValueError) as exc:
            print(f"{args.env_config}: cannot read a JSON env config: {exc}")
            return 1
    findings = check_config(
        config, sglang_args=args.sglang_args, env_config=engine_env, adapter_config=args.adapter_config
    )
    problems = [f for f in findings if f.severity == "problem"]
    for finding in findings:
        print(finding)
    if problems:
        print(f"{args.file}: {len(problems)} problem(s)")
        return 1
    print(f"{args.file}: OK")
    return 0


def _read_token_ids(path: str) -> list[int]:
    with open(path, encoding="utf-8") as handle:
        text = handle.read().strip()
    data = json.loads(text) if text.startswith("[") else [int(t) for t in text.replace(",", " ").split()]
    if not isinstance(data, list) or not all(isinstance(t, int) for t in data):
        raise ValueError(f"{path}: expected a JSON list of integers or whitespace-separated integers")
    return data


def _explain(args: argparse.Namespace) -> int:
    from motor_adapter.explain import format_report

    body: dict[str, Any] = {"model": args.model, "tenant_id": args.tenant, "block_size": args.block_size}
    try:
        if args.token_ids:
            body["token_ids"] = _read_token_ids(args.token_ids)
        else:
            with open(args.prompt_file, encoding="utf-8") as handle:
                text = handle.read()
            if args.chat:
                body["messages"] = json.loads(text)
            else:
                body["prompt"] = text
    except (OSError, ValueError) as exc:
        print(f"motor-kv-adapter explain: {exc}", file=sys.stderr)
        return 2
    request = urllib.request.Request(
        args.url.rstrip("/") + "/explain",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:
            report = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        print(f"motor-kv-adapter explain: HTTP {exc.code}: {exc.read().decode(errors='replace')}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"motor-kv-adapter explain: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report.get("verdict") == "hit" else 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="motor-kv-adapter", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the kv-conductor-compatible HTTP service")
    serve.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port (default 13333, Motor's http_server_port)")
    serve.add_argument("--config", default=None, help="service config JSON (see docs/motor.md)")
    serve.add_argument("--tokenizer", default=None, help="local tokenizer directory for prompt/messages queries")
    serve.add_argument(
        "--registry",
        default=None,
        help="where registrations outlive a restart: file:PATH (default: "
        "$XDG_STATE_HOME/motor-kv-adapter/registrations-<port>.json), etcd://HOST:PORT/PREFIX (replicas; "
        "TLS and auth: ?tls_ca=&tls_cert=&tls_key=&user=&password_file=, docs/operations.md), "
        "or memory (nothing survives); env MOTOR_KV_ADAPTER_REGISTRY",
    )
    serve.set_defaults(run=_serve)

    from motor_adapter.tools.register_cli import add_parsers

    add_parsers(sub)

    check = sub.add_parser("check-config", help="validate a Motor user_config.json for KV affinity with SGLang")
    check.add_argument("file")
    check.add_argument(
        "--sglang-args",
        default=None,
        help='SGLang launch command line, when SGLang runs outside Motor (write --sglang-args="...")',
    )
    check.add_argument(
        "--env-config",
        default=None,
        help="Motor's env config (env.json: motor_engine_prefill_env, motor_coordinator_env)",
    )
    check.add_argument(
        "--adapter-config",
        default=None,
        help="the adapter's serve --config JSON: its kv_affinity cost must equal the engine's plugin cost keys",
    )
    check.set_defaults(run=_check_config)

    explain = sub.add_parser("explain", help="ask a running adapter why a prompt hits or misses")
    explain.add_argument("--url", required=True, help="adapter URL, e.g. http://127.0.0.1:13333")
    source = explain.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt-file", help="a completions prompt (text), or chat messages JSON with --chat")
    source.add_argument("--token-ids", help="token ids: a JSON list or whitespace-separated integers")
    explain.add_argument("--chat", action="store_true", help="--prompt-file holds a JSON messages list")
    explain.add_argument("--model", default="default", help="served model name Motor registers (modelname)")
    explain.add_argument("--tenant", default="default")
    explain.add_argument("--block-size", type=int, default=128)
    explain.add_argument("--timeout", type=float, default=30.0)
    explain.add_argument("--json", action="store_true", help="print the JSON report")
    explain.set_defaults(run=_explain)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
