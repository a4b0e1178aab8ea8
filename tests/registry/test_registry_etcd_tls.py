"""The etcd registry over TLS and with etcd's user authentication, against the real etcd 3.5.

A throwaway CA, a server certificate (127.0.0.1) and a client certificate are made in the test's
temporary directory (the ``cryptography`` package; nothing is committed).  etcd is started with
them: mutual TLS (``--client-cert-auth``), or server TLS with users and passwords on.  Two
stores, as two replicas hold them, write, watch and delete through etcd3gw; a replica process
(``motor-kv-adapter serve --registry etcd://...?tls_ca=...``) reports itself connected.  A
missing or wrong certificate, a wrong password, and spec mistakes fail with the option named.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import ipaddress
import json
import os
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import free_tcp_port
from registry_procs import REQUIRE_ETCD_ENV, AdapterProcess, http, require_etcd, wait_for

from motor_adapter.registry.etcd import PASSWORD_ENV, EtcdStore
from motor_adapter.registry.store import Change, Record, RegistryError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PASSWORD = "s3cret-for-this-test"
BODY = {"instance_id": "vllm-prefill-0", "endpoint": "tcp://127.0.0.1:5557", "modelname": "m", "block_size": 16}


# --------------------------------------------------------------------------- throwaway PKI


def _pki(directory: Path) -> dict[str, str]:
    """ca.pem, server.pem/server.key (127.0.0.1), client.pem/client.key (CN root), other-ca.pem."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(stem: str, key: Any, cert: x509.Certificate) -> None:
        (directory / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        if key is not None:
            path = directory / f"{stem}.key"
            path.write_bytes(
                key.private_bytes(
                    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
                )
            )
            path.chmod(0o600)

    def authority(cn: str) -> tuple[Any, x509.Certificate]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(name(cn))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        return key, cert

    def leaf(cn: str, ca_key: Any, ca_cert: x509.Certificate, usage: Any, ip: bool) -> tuple[Any, x509.Certificate]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        )
        if ip:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
            )
        return key, builder.sign(ca_key, hashes.SHA256())

    ca_key, ca_cert = authority("kvpub test CA")
    write("ca", None, ca_cert)
    # etcd's JSON gateway dials etcd's own gRPC with the server certificate: it must be a client one too
    both = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    write("server", *leaf("127.0.0.1", ca_key, ca_cert, both, ip=True))
    write("client", *leaf("root", ca_key, ca_cert, [ExtendedKeyUsageOID.CLIENT_AUTH], ip=False))
    write("other-ca", None, authority("another CA")[1])
    return {stem: str(directory / stem) for stem in ("ca", "server", "client", "other-ca")}


# --------------------------------------------------------------------------- etcd over TLS


class TlsEtcd:
    """The real etcd on https://127.0.0.1:PORT with the test's certificates."""

    def __init__(self, binary: str, tmp: Path, pki: dict[str, str], *, mutual: bool, token_ttl_s: int = 300) -> None:
        self.pki = pki
        self.mutual = mutual
        self.client_port, peer_port = free_tcp_port(), free_tcp_port()
        self.url = f"https://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{peer_port}"
        self.log_path = tmp / "etcd.log"
        self.cmd = [
            binary,
            "--name=kvtls",
            f"--data-dir={tmp / 'etcd-data'}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=kvtls={peer}",
            f"--cert-file={pki['server']}.pem",
            f"--key-file={pki['server']}.key",
            f"--auth-token-ttl={token_ttl_s}",
            "--log-level=warn",
            "--unsafe-no-fsync",
        ]
        if mutual:  # (a trusted CA alone makes etcd 3.5 refuse clients without a certificate)
            self.cmd += ["--client-cert-auth", f"--trusted-ca-file={pki['ca']}.pem"]
        self.context = ssl.create_default_context(cafile=f"{pki['ca']}.pem")
        self.context.load_cert_chain(f"{pki['client']}.pem", f"{pki['client']}.key")
        self.token: str | None = None
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_for(self.healthy, f"etcd on {self.url}")

    def call(self, path: str, body: Any) -> tuple[int, Any]:
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = self.token
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=3.0, context=self.context) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"etcd exited {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
        request = urllib.request.Request(self.url + "/health")
        with urllib.request.urlopen(request, timeout=1.0, context=self.context) as response:
            return json.loads(response.read()).get("health") == "true"

    def enable_auth(self) -> None:
        """A root user with a password, then auth on (etcd's own sequence, through its gateway)."""
        for path, body in (
            ("/v3/auth/role/add", {"name": "root"}),
            ("/v3/auth/user/add", {"name": "root", "password": PASSWORD}),
            ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
            ("/v3/auth/enable", {}),
        ):
            status, answer = self.call(path, body)
            assert status == 200, (path, answer)
        self.login()

    def login(self) -> None:
        self.token = None
        status, answer = self.call("/v3/auth/authenticate", {"name": "root", "password": PASSWORD})
        assert status == 200, answer
        self.token = answer["token"]

    def keys(self, prefix: str) -> list[str]:
        if self.token:
            self.login()  # a fresh token: they live 1 s here
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        body = {"key": base64.b64encode(prefix.encode()).decode(), "range_end": base64.b64encode(end.encode()).decode()}
        status, data = self.call("/v3/kv/range", body)
        assert status == 200, data
        return sorted(base64.b64decode(kv["key"]).decode() for kv in data.get("kvs", []))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, str]:
    # Without etcd these tests skip (or fail where CI requires etcd) before the PKI is made; the
    # certificate maker comes with the registry tier's requirements, beside the etcd server.
    require_etcd()
    try:
        import cryptography  # noqa: F401
    except ImportError:
        reason = "no cryptography package: pip install -r .ci/requirements-registry.txt"
        if os.environ.get(REQUIRE_ETCD_ENV):
            pytest.fail(reason)
        pytest.skip(reason)
    directory = tmp_path / "pki"
    directory.mkdir()
    return _pki(directory)


@pytest.fixture
def mutual_etcd(tmp_path: Path, pki: dict[str, str]) -> Iterator[TlsEtcd]:
    server = TlsEtcd(require_etcd(), tmp_path, pki, mutual=True)
    yield server
    server.stop()


@pytest.fixture
def auth_etcd(tmp_path: Path, pki: dict[str, str]) -> Iterator[TlsEtcd]:
    """Server TLS and users; a token lives 1 s, so a replica must take new ones as it goes."""
    server = TlsEtcd(require_etcd(), tmp_path, pki, mutual=False, token_ttl_s=1)
    server.enable_auth()
    yield server
    server.stop()


def _spec(server: TlsEtcd, query: str) -> str:
    return f"etcd://127.0.0.1:{server.client_port}/kvtls?lease_ttl=3&{query}"


def _mutual(pki: dict[str, str]) -> str:
    return f"tls_ca={pki['ca']}.pem&tls_cert={pki['client']}.pem&tls_key={pki['client']}.key"


async def _next_change(store: EtcdStore, kind: str) -> Change:
    changes = store.changes()
    assert changes is not None
    async for change in changes:
        if change.kind == kind:
            return change
    raise AssertionError("the change stream ended")


async def _two_replicas_share(spec: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """A writes a registration; B, already watching, sees it; A deletes it; B sees that too."""
    a, b = EtcdStore.from_url(spec, env=env), EtcdStore.from_url(spec, env=env)
    try:
        await a.open()
        await b.open()
        assert a.status()["connected"] and b.status()["connected"], (a.last_error, b.last_error)
        key = ("default", "m", "vllm-prefill-0", 0)
        written = await a.put(Record(key, BODY))
        assert written.revision > 0
        seen = await asyncio.wait_for(_next_change(b, "put"), 20)
        assert seen.record is not None and dict(seen.record.body) == BODY
        assert await a.delete(key)
        gone = await asyncio.wait_for(_next_change(b, "delete"), 20)
        assert gone.key == key
        return b.status()
    finally:
        await a.close()
        await b.close()


# --------------------------------------------------------------------------- tests


def test_two_replicas_share_registrations_over_mutual_tls(mutual_etcd: TlsEtcd, pki: dict[str, str]) -> None:
    status = asyncio.run(_two_replicas_share(_spec(mutual_etcd, _mutual(pki))))
    assert status["tls"] is True and status["endpoints"] == [mutual_etcd.url]


def test_without_the_client_certificate_mutual_tls_refuses_and_says_why(
    mutual_etcd: TlsEtcd, pki: dict[str, str]
) -> None:
    async def attempt(query: str) -> str:
        store = EtcdStore.from_url(_spec(mutual_etcd, query) + "&connect_wait=2")
        try:
            await store.open()
            assert not store.status()["connected"]
            return str(store.last_error)
        finally:
            await store.close()

    no_cert = asyncio.run(attempt(f"tls_ca={pki['ca']}.pem"))
    assert "etcd unreachable" in no_cert and "SSL" in no_cert, no_cert
    other = f"tls_ca={pki['other-ca']}.pem&tls_cert={pki['client']}.pem&tls_key={pki['client']}.key"
    wrong_ca = asyncio.run(attempt(other))
    assert "CERTIFICATE_VERIFY_FAILED" in wrong_ca or "certificate verify failed" in wrong_ca, wrong_ca


def test_two_replicas_share_registrations_as_an_etcd_user_over_tls(auth_etcd: TlsEtcd, pki: dict[str, str]) -> None:
    spec = _spec(auth_etcd, f"tls_ca={pki['ca']}.pem&user=root")
    status = asyncio.run(_two_replicas_share(spec, env={PASSWORD_ENV: PASSWORD}))
    assert status["user"] == "root" and PASSWORD not in json.dumps(status)


def test_an_expired_token_is_taken_again(auth_etcd: TlsEtcd, pki: dict[str, str], tmp_path: Path) -> None:
    secret = tmp_path / "etcd-password"
    secret.write_text(PASSWORD + "\n")
    spec = _spec(auth_etcd, f"tls_ca={pki['ca']}.pem&user=root&password_file={secret}")

    async def run() -> None:
        store = EtcdStore.from_url(spec, env={})
        try:
            await store.open()
            assert store.status()["connected"], store.last_error
            await store.put(Record(("default", "m", "i", 0), BODY))
            logins = store.status()["logins"]
            time.sleep(2.5)  # past the 1 s token TTL etcd was started with: a clock, no event to await
            await store.put(Record(("default", "m", "i", 1), BODY))
            assert store.status()["logins"] > logins  # the expired token was refused and taken again
        finally:
            await store.close()

    asyncio.run(run())
    assert auth_etcd.keys("/kvtls/registrations/") == [
        "/kvtls/registrations/default/m/i/0",
        "/kvtls/registrations/default/m/i/1",
    ]


def test_a_wrong_password_is_reported_naming_the_user_and_the_fix(auth_etcd: TlsEtcd, pki: dict[str, str]) -> None:
    async def run() -> str:
        store = EtcdStore.from_url(_spec(auth_etcd, f"tls_ca={pki['ca']}.pem&user=root"), env={PASSWORD_ENV: "nope"})
        try:
            await store.open()
            assert not store.status()["connected"]
            return str(store.last_error)
        finally:
            await store.close()

    error = asyncio.run(run())
    assert "etcd refused user 'root'" in error and "password_file or MOTOR_KV_ADAPTER_ETCD_PASSWORD" in error, error
    assert "nope" not in error


def test_a_replica_process_connects_over_mutual_tls(mutual_etcd: TlsEtcd, pki: dict[str, str], tmp_path: Path) -> None:
    adapter = AdapterProcess(_spec(mutual_etcd, _mutual(pki)), tmp_path / "adapter.log")
    try:
        adapter.start()

        def connected() -> Any:
            code, body = http(adapter.url + "/registry")
            return body if code == 200 and body.get("connected") else None

        status = wait_for(connected, "the adapter connected to etcd over TLS")
        assert status["tls"] is True, status
        assert any(key.startswith("/kvtls/replicas/") for key in mutual_etcd.keys("/kvtls/replicas/"))
    finally:
        adapter.stop()


@pytest.mark.unit
@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("tls_ca=/nonexistent/ca.pem", "tls_ca='/nonexistent/ca.pem' cannot be read"),
        ("tls_cert=/x.pem", "tls_cert and tls_key go together"),
        ("tls=yes", "tls='yes': write tls=1"),
        ("user=root", f"user 'root' has no password: add password_file=PATH or set {PASSWORD_ENV}"),
        ("password_file=/x", "password_file without user"),
        ("user=root&password_file=/nonexistent/pw", "password_file='/nonexistent/pw' cannot be read"),
        ("tls_ca", "tls_ca is empty"),
    ],
)
def test_a_bad_security_option_fails_the_start_naming_it(query: str, named: str) -> None:
    with pytest.raises(RegistryError) as caught:
        EtcdStore.from_url(f"etcd://127.0.0.1:2379/p?{query}", env={})
    assert named in str(caught.value)
