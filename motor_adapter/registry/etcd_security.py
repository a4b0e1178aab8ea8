"""The etcd registry spec's TLS and auth options (``tls``, ``tls_ca``, ``tls_cert``, ``tls_key``,
``user``, ``password_file``), each checked when the spec is read: a file that cannot be read or
an option without its partner stops the start, naming the option and the fix.  The password
comes from a file or :data:`PASSWORD_ENV`, never from the spec, which is logged."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Union

from motor_adapter.registry.etcd_gateway import EtcdAuth, EtcdTls
from motor_adapter.registry.store import RegistryError

__all__ = ["PASSWORD_ENV", "SECURITY_OPTIONS", "security_options"]

log = logging.getLogger(__name__)

PASSWORD_ENV = "MOTOR_KV_ADAPTER_ETCD_PASSWORD"
SECURITY_OPTIONS = ("tls", "tls_ca", "tls_cert", "tls_key", "user", "password_file")


def _readable(url: str, option: str, path: str) -> str:
    if not path:
        raise RegistryError(f"--registry {url!r}: {option} is empty: give a file path")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise RegistryError(
            f"--registry {url!r}: {option}={path!r} cannot be read ({exc.strerror}): give a readable PEM file"
        ) from None
    return path


def security_options(
    url: str, given: Mapping[str, str], env: Mapping[str, str]
) -> tuple[Union[EtcdTls, None], Union[EtcdAuth, None]]:
    """The spec's TLS and auth options, each file checked now (a bad one fails the start, named)."""
    tls_flag = given.get("tls", "")
    if tls_flag not in ("", "0", "1", "true", "false"):
        raise RegistryError(f"--registry {url!r}: tls={tls_flag!r}: write tls=1 (https) or leave it out")
    ca, cert, key = (given.get(name) for name in ("tls_ca", "tls_cert", "tls_key"))
    if (cert is None) != (key is None):
        raise RegistryError(
            f"--registry {url!r}: tls_cert and tls_key go together (this client's certificate and its key): give both"
        )
    tls = None
    if tls_flag in ("1", "true") or ca is not None or cert is not None:
        tls = EtcdTls(
            ca=_readable(url, "tls_ca", ca) if ca is not None else None,
            cert=_readable(url, "tls_cert", cert) if cert is not None else None,
            key=_readable(url, "tls_key", key) if key is not None else None,
        )
    user, password_file = given.get("user"), given.get("password_file")
    if user is None:
        if password_file is not None:
            raise RegistryError(f"--registry {url!r}: password_file without user: add user=NAME")
        return tls, None
    if not user:
        raise RegistryError(f"--registry {url!r}: user is empty: give etcd's user name")
    if password_file is not None:
        with open(_readable(url, "password_file", password_file), encoding="utf-8") as handle:
            password = handle.read().rstrip("\r\n")
    elif env.get(PASSWORD_ENV):
        password = env[PASSWORD_ENV]
    else:
        raise RegistryError(
            f"--registry {url!r}: user {user!r} has no password: add password_file=PATH or set {PASSWORD_ENV}"
        )
    if tls is None:
        log.warning("registry %s: etcd user %r without TLS: the password crosses the network in clear", url, user)
    return tls, EtcdAuth(user, password)
