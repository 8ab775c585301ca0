"""A throwaway PKI for the test control plane, made with the openssl command line.

The venv has no ``cryptography`` package, and the project must not grow a dependency for
its tests' certificates, so this shells out to openssl (present on every Debian image).
Keys are ECDSA P-256: quick to generate, accepted by every component.
"""

from __future__ import annotations

import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path

VALIDITY_DAYS = 30


class PKIError(RuntimeError):
    pass


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise PKIError(f"openssl {' '.join(args)} failed: {proc.stderr.strip()}")


def _ec_key(path: Path) -> None:
    _openssl(
        "genpkey",
        "-algorithm",
        "EC",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-out",
        str(path),
        cwd=path.parent,
    )
    path.chmod(0o600)


@dataclass(frozen=True)
class CertPair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class ClusterPKI:
    """Paths of everything the components and clients need."""

    directory: Path
    ca: CertPair
    apiserver: CertPair
    service_account_key: Path  # private: signs tokens (apiserver) and legacy secrets (KCM)
    service_account_pub: Path  # public: verifies tokens (apiserver)
    clients: dict[str, CertPair]

    @classmethod
    def load(cls, directory: Path, client_names: list[str]) -> ClusterPKI:
        return cls(
            directory=directory,
            ca=CertPair(directory / "ca.crt", directory / "ca.key"),
            apiserver=CertPair(directory / "apiserver.crt", directory / "apiserver.key"),
            service_account_key=directory / "sa.key",
            service_account_pub=directory / "sa.pub",
            clients={
                name: CertPair(directory / f"{name}.crt", directory / f"{name}.key")
                for name in client_names
            },
        )


def sign_certificate(
    directory: Path, ca: CertPair, name: str, subject: str, extensions: str
) -> CertPair:
    """A key and a certificate for ``subject`` (an openssl ``/O=../CN=..`` string) signed by
    ``ca``, with ``extensions`` (openssl extension-file lines) added to the leaf defaults."""
    pair = CertPair(directory / f"{name}.crt", directory / f"{name}.key")
    csr = directory / f"{name}.csr"
    ext = directory / f"{name}.ext"
    _ec_key(pair.key)
    _openssl(
        "req", "-new", "-key", str(pair.key), "-subj", subject, "-out", str(csr), cwd=directory
    )
    ext.write_text(
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature\n"
        "subjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid\n" + extensions
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca.cert),
        "-CAkey",
        str(ca.key),
        "-set_serial",
        "0x" + secrets.token_hex(16),
        "-days",
        str(VALIDITY_DAYS),
        "-extfile",
        str(ext),
        "-out",
        str(pair.cert),
        cwd=directory,
    )
    csr.unlink()
    ext.unlink()
    return pair


def create_ca(directory: Path, name: str, subject: str) -> CertPair:
    """A self-signed CA, ``<name>.crt`` and ``<name>.key``, for ``subject``."""
    ca = CertPair(directory / f"{name}.crt", directory / f"{name}.key")
    _ec_key(ca.key)
    _openssl(
        "req",
        "-x509",
        "-new",
        "-key",
        str(ca.key),
        "-subj",
        subject,
        "-days",
        str(VALIDITY_DAYS),
        "-out",
        str(ca.cert),
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        cwd=directory,
    )
    return ca


def create_pki(
    directory: Path,
    *,
    serving_ips: list[str],
    serving_dns: list[str],
    clients: dict[str, tuple[str, list[str]]],
) -> ClusterPKI:
    """Create a CA, the apiserver serving pair, the service-account key pair and one client
    certificate per entry of ``clients`` (file stem -> (common name = user, organisations =
    groups))."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = create_ca(directory, "ca", "/CN=k8s-rendezvous-test-ca")
    sans = [f"IP:{ip}" for ip in serving_ips] + [f"DNS:{name}" for name in serving_dns]
    sign_certificate(
        directory,
        ca,
        "apiserver",
        "/CN=kube-apiserver",
        f"extendedKeyUsage=serverAuth\nsubjectAltName={','.join(sans)}\n",
    )
    for stem, (user, groups) in clients.items():
        subject = "".join(f"/O={group}" for group in groups) + f"/CN={user}"
        sign_certificate(directory, ca, stem, subject, "extendedKeyUsage=clientAuth\n")
    sa_key = directory / "sa.key"
    sa_pub = directory / "sa.pub"
    _ec_key(sa_key)
    _openssl("pkey", "-in", str(sa_key), "-pubout", "-out", str(sa_pub), cwd=directory)
    return ClusterPKI.load(directory, list(clients))
