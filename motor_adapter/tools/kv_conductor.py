"""``kv-conductor``: the adapter under the name and command line Motor 3.1's deployer starts.

Motor 3.1's role script (``examples/deployer/startup/roles/kv_conductor.sh``) looks for an
executable ``kv-conductor`` in ``/usr/local/bin``, ``/opt/motor/bin`` and ``./`` and runs
``kv-conductor --host $KV_CONDUCTOR_HOST --port $KV_CONDUCTOR_PORT``, nothing else.  So
every other setting comes from the environment or a config file at a default path:

- ``MOTOR_KV_ADAPTER_CONFIG``: the service config (the JSON ``motor-kv-adapter serve
  --config`` reads); unset: ``/etc/motor-kv-adapter/config.json`` when that file exists,
  else the defaults.  A config that cannot be read or is wrong fails the start, naming the
  key and the fix (exit 2, before the port opens).
- ``MOTOR_KV_ADAPTER_TOKENIZER``: a local tokenizer directory (prompt/messages queries).
- ``MOTOR_KV_ADAPTER_REGISTRY``, ``MOTOR_KV_ADAPTER_TOKEN``, ``MOTOR_KV_ADAPTER_MAX_STREAMS``:
  as for ``motor-kv-adapter serve``.
- ``RUST_LOG`` (the role script's knob for Motor's Rust conductor): its level word
  (``error``, ``warn``, ``info``, ``debug``, ``trace``) sets the log level; default info.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence

__all__ = ["CONFIG_ENV", "DEFAULT_CONFIG_PATH", "TOKENIZER_ENV", "build_parser", "config_path", "main"]

CONFIG_ENV = "MOTOR_KV_ADAPTER_CONFIG"
TOKENIZER_ENV = "MOTOR_KV_ADAPTER_TOKENIZER"
DEFAULT_CONFIG_PATH = "/etc/motor-kv-adapter/config.json"
_RUST_LEVELS = {"error": "ERROR", "warn": "WARNING", "info": "INFO", "debug": "DEBUG", "trace": "DEBUG"}


def config_path(env: Mapping[str, str]) -> str | None:
    """The service config to read: ``$MOTOR_KV_ADAPTER_CONFIG``, else the default path if it exists."""
    given = env.get(CONFIG_ENV)
    if given:
        return given
    return DEFAULT_CONFIG_PATH if os.path.isfile(DEFAULT_CONFIG_PATH) else None


def _log_level(env: Mapping[str, str]) -> str:
    """``RUST_LOG``'s level: its last bare level word (``info``, ``warn,hyper=info``...), else INFO."""
    words = [part.strip().lower() for part in env.get("RUST_LOG", "").split(",")]
    levels = [_RUST_LEVELS[w] for w in words if w in _RUST_LEVELS]
    return levels[-1] if levels else "INFO"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kv-conductor",
        description="motor-kv-adapter serving Motor's kv-conductor API (Motor 3.1's deployer starts it so). "
        f"Other settings: ${CONFIG_ENV} (default {DEFAULT_CONFIG_PATH} if present), ${TOKENIZER_ENV}, "
        "$MOTOR_KV_ADAPTER_REGISTRY, $RUST_LOG (docs/motor.md).",
    )
    parser.add_argument("--host", default=None, help="bind address (default: the config's, else 127.0.0.1)")
    parser.add_argument("-p", "--port", type=int, default=None, help="port (default: the config's, else 13333)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = os.environ
    logging.basicConfig(level=_log_level(env), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from motor_adapter.tools.cli import serve_config

    path = config_path(env)
    return serve_config(
        path,
        host=args.host,
        port=args.port,
        tokenizer=env.get(TOKENIZER_ENV) or None,
        registry=None,
        origin=f"kv-conductor: config {path} (${CONFIG_ENV})" if path else "kv-conductor",
    )


if __name__ == "__main__":
    sys.exit(main())
