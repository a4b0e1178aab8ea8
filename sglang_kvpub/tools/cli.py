"""``sglang-kvpub``: tail any KV-event stream, run the fan-in sidecar, run the demo."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Each subcommand lives in its own module with ``add_parser(subparsers)`` and is imported
# only when listed here, so ``sglang-kvpub tail`` never pays for the demo's imports.
_SUBCOMMANDS = (
    "sglang_kvpub.tools.tail",
    "sglang_kvpub.tools.sidecar",
    "sglang_kvpub.tools.demo",
    "sglang_kvpub.tools.keygen",
    "sglang_kvpub.tools.check_config",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sglang-kvpub", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in _SUBCOMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # subcommand not built yet
                continue
            raise
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
