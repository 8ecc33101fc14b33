"""`nodesampler kube-secrets DIR`: the files the shipped kustomization's
secretGenerator reads (deploy/kubernetes/kustomization.yaml), so that
`kubectl apply -k` works on a cluster with nothing prepared.

Each file is made only where it is missing (a second run changes nothing;
to rotate one, remove it and run again), the directory 0700, the files
0600: a CA and the control plane's certificate (every name the agents, the
replicas, Prometheus and a port-forward reach it by), the web config with
two users (`prometheus`, `operator`) and their passwords, and the replicas'
peer secret."""

from __future__ import annotations

import argparse
import datetime
import functools
import ipaddress
import os
import secrets
from collections.abc import Callable
from pathlib import Path

NAMESPACE = "nodesampler"
# The names the shipped manifests reach the control plane by (docs/deployment.md, "2."):
# each replica through the headless Service, the pages' Service, and a port-forward.
SERVICE_NAMES = [f"*.nodesampler-controlplane.{NAMESPACE}.svc", f"nodesampler-controlplane.{NAMESPACE}.svc",
                 f"nodesampler-pages.{NAMESPACE}.svc", "localhost"]  # fmt: skip
USERS = ("prometheus", "operator")
CA_DAYS, CERT_DAYS = 3650, 825  # 825: the longest a browser accepts for a server certificate

# Where the web config finds the certificate: the StatefulSet's mount of the TLS Secret.
WEB_CONFIG = """\
# Made by `nodesampler kube-secrets`: the control plane's web config
# (--web-config-file), the exporter-toolkit's format.
tls_server_config:
  cert_file: /etc/nodesampler/tls/tls.crt
  key_file: /etc/nodesampler/tls/tls.key
basic_auth_users:
{users}"""


def _write_new(path: Path, make: Callable[[], bytes]) -> bool:
    """`path` with what `make` gives, 0600, unless it exists; whether it was made."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(make())
    return True


def _certificates(directory: Path) -> list[str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())  # fmt: skip

    made = []
    now = datetime.datetime.now(datetime.UTC)
    if not (directory / "ca.crt").exists():
        (directory / "ca.key").unlink(missing_ok=True)  # a CA whose certificate went is made again, whole
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = (x509.CertificateBuilder().subject_name(name("nodesampler CA")).issuer_name(name("nodesampler CA"))
              .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now - datetime.timedelta(minutes=5))
              .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
              .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
              .sign(ca_key, hashes.SHA256()))  # fmt: skip
        _write_new(directory / "ca.key", lambda: pem_key(ca_key))
        _write_new(directory / "ca.crt", lambda: ca.public_bytes(serialization.Encoding.PEM))
        (directory / "tls.crt").unlink(missing_ok=True)  # signed by the CA that went
        made += ["ca.crt", "ca.key"]
    if not (directory / "tls.crt").exists():
        ca = x509.load_pem_x509_certificate((directory / "ca.crt").read_bytes())
        issuer_key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), None)
        if not isinstance(issuer_key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):  # a CA of the operator's
            raise ValueError("ca.key is neither an EC nor an RSA key")
        key = ec.generate_private_key(ec.SECP256R1())
        names: list[x509.GeneralName] = [x509.DNSName(n) for n in SERVICE_NAMES]
        names.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
        cert = (x509.CertificateBuilder().subject_name(name("nodesampler-controlplane")).issuer_name(ca.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .sign(issuer_key, hashes.SHA256()))  # fmt: skip
        (directory / "tls.key").unlink(missing_ok=True)
        _write_new(directory / "tls.key", lambda: pem_key(key))
        _write_new(directory / "tls.crt", lambda: cert.public_bytes(serialization.Encoding.PEM))
        made += ["tls.crt", "tls.key"]
    return made


FILES = ("ca.crt", "ca.key", "tls.crt", "tls.key", *(f"{u}.password" for u in USERS), "web-config.yml",
         "peers.secret")  # fmt: skip


def _password(path: Path) -> bytes:
    """A password file's bytes, which the Secret holds as they are: one with
    space around it would be sent with the space and refused."""
    password = path.read_bytes()
    if not password or password != password.strip():
        raise ValueError(f"{path.name} is empty or has spaces or a newline around it: the Secret would hold "
                         "them and the password would not match (write it with printf '%s')")  # fmt: skip
    return password


def write(directory: Path) -> list[str]:
    """The files of `directory` that were missing, made; their names."""
    import bcrypt

    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    passwords = {}
    for user in USERS:  # checked before anything is made: a refusal changes nothing
        path = directory / f"{user}.password"
        passwords[user] = _password(path) if path.exists() else None
    made = _certificates(directory)
    for user in USERS:
        if passwords[user] is None:
            password = secrets.token_urlsafe(24).encode()
            _write_new(directory / f"{user}.password", functools.partial(bytes, password))
            passwords[user] = password
            made.append(f"{user}.password")
            (directory / "web-config.yml").unlink(missing_ok=True)  # it must hash the new password
    if not (directory / "web-config.yml").exists():
        hashes = {u: bcrypt.hashpw(p, bcrypt.gensalt(10)).decode() for u, p in passwords.items() if p}
        users = "".join(f"  {u}: {h}\n" for u, h in hashes.items())
        _write_new(directory / "web-config.yml", lambda: WEB_CONFIG.format(users=users).encode())
        made.append("web-config.yml")
    if _write_new(directory / "peers.secret", lambda: secrets.token_hex(32).encode()):
        made.append("peers.secret")
    return made


def cmd_kube_secrets(args: argparse.Namespace) -> int:
    from nodesampler.cli.parser import EXIT_USAGE, fail

    try:
        made = write(args.directory)
    except (OSError, ValueError) as e:
        fail(EXIT_USAGE, f"{args.directory}: {e}")
    kept = [f for f in FILES if f not in made]
    said = [f"made {', '.join(made)}"] if made else []
    said += [f"kept {', '.join(kept)}"] if kept else []
    print(f"{args.directory}: {'; '.join(said)}. The pages' users are prometheus and operator, their passwords in "
          f"{args.directory}/*.password. Then: kubectl apply -k {args.directory.parent}")  # fmt: skip
    return 0
