"""``sglang-kvpub keygen``: a CURVE key pair for the instance stream (server) or a subscriber (client).

Key files are the format ``zmq.auth`` writes (see :mod:`sglang_kvpub.transport.curve` and
docs/security.md).
"""

from __future__ import annotations

import argparse
from typing import Any

from sglang_kvpub.transport import curve
from sglang_kvpub.transport.curve import generate_keypair, load_public_key

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "keygen",
        help="create a CURVE key pair for the instance stream (server) or a subscriber (client)",
        description=curve.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dir", required=True, help="directory for NAME.key and NAME.key_secret")
    parser.add_argument("--name", default="server", help="file name stem (default: server)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    public, secret = generate_keypair(args.dir, args.name)
    key = load_public_key(public).decode("ascii")
    print(f"public key file: {public}\nsecret key file: {secret} (mode 0600, keep it private)\npublic key: {key}")
    return 0
