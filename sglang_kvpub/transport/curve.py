"""Optional ZMQ CURVE for the instance stream (PUB) and its replay ROUTER.

CURVE (pyzmq/libzmq, Curve25519) encrypts every frame and authenticates the server: a
subscriber must know the fan-in's public key, and a client that speaks plain ZMQ, or
holds the wrong server key, never completes the handshake and receives nothing.
Optionally the server also authenticates clients: with ``curve_authorized_keys`` (a
directory of ``*.key`` public-key files) a ZAP handler admits only those clients.

Key files are the format ``zmq.auth`` writes and reads (Z85 keys in a small text file):
``NAME.key`` holds the public key, ``NAME.key_secret`` the public and the secret key
(written mode 0600).  ``sglang-kvpub keygen --dir DIR --name NAME``
(:mod:`sglang_kvpub.tools.keygen`) creates a pair.

This module imports only pyzmq; both halves of the project may use it (the router side
passes keys through ``StreamOptions``).  See docs/security.md.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Union

import zmq
import zmq.auth

__all__ = [
    "CurveServerKeys",
    "CurveClientKeys",
    "SecurityError",
    "generate_keypair",
    "load_public_key",
    "load_secret_key",
    "server_keys_from_files",
    "client_keys",
    "apply_server",
    "apply_client",
    "start_authenticator",
]


class SecurityError(ValueError):
    """A key file that cannot be used; the message names the file and the fix."""


@dataclasses.dataclass(frozen=True)
class CurveServerKeys:
    public: bytes
    secret: bytes


@dataclasses.dataclass(frozen=True)
class CurveClientKeys:
    server_public: bytes
    public: bytes
    secret: bytes


def generate_keypair(directory: Union[str, Path], name: str) -> tuple[Path, Path]:
    """Writes ``NAME.key`` (public) and ``NAME.key_secret`` (0600); returns both paths."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(path), name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def _load(path: Union[str, Path]) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise SecurityError(
            f"{path}: not a readable CURVE key file ({exc}); create one with sglang-kvpub keygen"
        ) from None
    if public is None or len(public) != 40:
        raise SecurityError(f"{path}: no Z85 public key in it; create one with sglang-kvpub keygen")
    return public, secret


def load_public_key(path_or_key: Union[str, Path, bytes]) -> bytes:
    """A Z85 public key given inline (40 characters) or as a key file."""
    if isinstance(path_or_key, bytes):
        key = path_or_key
    elif isinstance(path_or_key, str) and len(path_or_key) == 40 and not os.path.exists(path_or_key):
        key = path_or_key.encode("ascii")
    else:
        return _load(path_or_key)[0]
    if len(key) != 40:
        raise SecurityError("a CURVE public key is 40 Z85 characters")
    return key


def load_secret_key(path: Union[str, Path]) -> CurveServerKeys:
    public, secret = _load(path)
    if secret is None or len(secret) != 40:
        raise SecurityError(f"{path}: no secret key in it (use the NAME.key_secret file)")
    if (os.stat(path).st_mode & 0o077) != 0:
        raise SecurityError(f"{path}: readable by group or others; chmod 600 it")
    return CurveServerKeys(public=public, secret=secret)


def server_keys_from_files(
    secret_file: Union[str, None], public_file: Union[str, None] = None
) -> CurveServerKeys | None:
    """The fan-in's keys from its config (None: CURVE off); a public file must match the secret."""
    if not secret_file:
        if public_file:
            raise SecurityError("curve_public_key_file is set without curve_secret_key_file: set both or neither")
        return None
    keys = load_secret_key(secret_file)
    if public_file and load_public_key(public_file) != keys.public:
        raise SecurityError(f"{public_file} does not match {secret_file}: they are not one key pair")
    return keys


def client_keys(server_public: Union[str, Path, bytes], client_secret_file: Union[str, None] = None) -> CurveClientKeys:
    """A subscriber's keys: the server's public key plus its own pair (ephemeral when no file)."""
    server = load_public_key(server_public)
    if client_secret_file:
        own = load_secret_key(client_secret_file)
        return CurveClientKeys(server, own.public, own.secret)
    public, secret = zmq.curve_keypair()
    return CurveClientKeys(server, public, secret)


def apply_server(socket: zmq.Socket[Any], keys: CurveServerKeys | None) -> None:
    """Makes ``socket`` a CURVE server; call before bind/connect.  None: plain ZMQ."""
    if keys is None:
        return
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_server = True


def apply_client(socket: zmq.Socket[Any], keys: CurveClientKeys | None) -> None:
    """Makes ``socket`` a CURVE client of the server whose public key it holds; before connect."""
    if keys is None:
        return
    socket.curve_serverkey = keys.server_public
    socket.curve_publickey = keys.public
    socket.curve_secretkey = keys.secret


def start_authenticator(context: zmq.Context[Any], authorized_keys_dir: Union[str, None]) -> Any:
    """With a directory of client ``*.key`` files: a ZAP thread admitting only those clients.

    Returns the authenticator (call ``.stop()``), or None when every client that knows the
    server key may connect (CURVE still encrypts and authenticates the server).
    """
    if not authorized_keys_dir:
        return None
    if not Path(authorized_keys_dir).is_dir():
        raise SecurityError(f"curve_authorized_keys {authorized_keys_dir!r} is not a directory of *.key files")
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve(domain="*", location=str(authorized_keys_dir))
    return auth
