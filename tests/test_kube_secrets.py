"""`nodesampler kube-secrets DIR`: the files the shipped kustomization's
Secrets are generated from, made where missing, usable as they are: the
certificate names every Service the manifests reach the control plane by
and chains to the CA, the web config loads (with its files where the
StatefulSet mounts them) and holds each user's password, and a second run
changes nothing."""

from __future__ import annotations

import hashlib
import stat
import subprocess
import sys
from pathlib import Path

import bcrypt
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from controlplane.listen import web_config
from nodesampler.cli.kube_secrets import FILES, USERS
from tests.podman_pods import manifests, secret_data


def kube_secrets(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nodesampler", "kube-secrets", str(directory)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    key = ca.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey) and cert.signature_hash_algorithm is not None
    key.verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(cert.signature_hash_algorithm))  # raises if not
    return cert.issuer == ca.subject


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_it_writes_every_file_the_secrets_are_made_from(tmp_path: Path) -> None:
    secrets = tmp_path / "secrets"
    r = kube_secrets(secrets)
    assert r.returncode == 0, r.stderr
    assert f"made {', '.join(FILES)}." in r.stdout and "kubectl apply -k" in r.stdout
    assert sorted(p.name for p in secrets.iterdir()) == sorted(FILES)
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in secrets.iterdir()} == {0o600}
    # The certificate: signed by the CA the agents are given, naming each way the manifests reach it.
    ca = x509.load_pem_x509_certificate((secrets / "ca.crt").read_bytes())
    cert = x509.load_pem_x509_certificate((secrets / "tls.crt").read_bytes())
    assert signed_by(cert, ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(names.get_values_for_type(x509.DNSName)) == {
        "*.nodesampler-controlplane.nodesampler.svc", "nodesampler-controlplane.nodesampler.svc",
        "nodesampler-pages.nodesampler.svc", "localhost"}  # fmt: skip
    docs = manifests(secrets=secrets)
    [sts] = [d for d in docs if d["kind"] == "StatefulSet"]
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    peers = [a.split("//")[1].split(":")[0] for a in args if a.startswith("--peer=")]
    assert peers and all(p.split(".", 1)[1] == "nodesampler-controlplane.nodesampler.svc" for p in peers)
    # The web config, with its files where the StatefulSet mounts the TLS Secret: it loads, and holds each
    # user's password (the Prometheus Secret's is prometheus').
    mounted = tmp_path / "etc-nodesampler-tls"
    mounted.mkdir()
    for key, value in secret_data(docs, "nodesampler-controlplane-tls").items():
        (mounted / key).write_bytes(value)
    text = secret_data(docs, "nodesampler-controlplane-web")["web-config.yml"].decode()
    assert "/etc/nodesampler/tls/tls.crt" in text
    (tmp_path / "web-config.yml").write_text(text.replace("/etc/nodesampler/tls/", f"{mounted}/"))
    config = web_config.load(tmp_path / "web-config.yml")
    assert config.tls is not None and set(config.users) == set(USERS)
    for user in USERS:
        assert bcrypt.checkpw((secrets / f"{user}.password").read_bytes(), config.users[user])
    auth = secret_data(docs, "nodesampler-prometheus-auth")
    assert auth == {"username": b"prometheus", "password": (secrets / "prometheus.password").read_bytes()}
    assert len(secret_data(docs, "nodesampler-controlplane-peers")["secret"]) == 64  # 32 bytes, hex


def test_a_second_run_keeps_everything_and_a_removed_file_is_made_again(tmp_path: Path) -> None:
    secrets = tmp_path / "secrets"
    assert kube_secrets(secrets).returncode == 0
    before = digests(secrets)
    r = kube_secrets(secrets)
    assert r.returncode == 0 and "made" not in r.stdout and digests(secrets) == before
    # A password removed (to rotate it): a new one, and the web config that holds its hash; the rest kept.
    (secrets / "operator.password").unlink()
    r = kube_secrets(secrets)
    assert "made operator.password, web-config.yml;" in r.stdout
    after = digests(secrets)
    assert {k for k in before if before[k] != after[k]} == {"operator.password", "web-config.yml"}
    # The CA removed: a new CA and a certificate it signs (the old one chains to a CA that is gone).
    (secrets / "ca.crt").unlink()
    assert "made ca.crt, ca.key, tls.crt, tls.key;" in kube_secrets(secrets).stdout
    ca = x509.load_pem_x509_certificate((secrets / "ca.crt").read_bytes())
    assert signed_by(x509.load_pem_x509_certificate((secrets / "tls.crt").read_bytes()), ca)


def test_a_password_with_a_newline_is_refused_and_nothing_made(tmp_path: Path) -> None:
    """`echo secret > prometheus.password` puts the newline in the Secret:
    Prometheus would send it, and its password would never match."""
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "prometheus.password").write_text("hunter2\n")
    r = kube_secrets(secrets)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "prometheus.password" in r.stderr and "printf" in r.stderr
    assert [p.name for p in secrets.iterdir()] == ["prometheus.password"]


def test_a_ca_of_the_operator_s_own_signs_the_certificate(tmp_path: Path) -> None:
    """ca.crt and ca.key put there first (the cluster's own CA): the
    certificate is made with them, and they are kept."""
    from tests.certs import TestCA

    secrets = tmp_path / "secrets"
    secrets.mkdir(mode=0o700)
    own = TestCA("the operator's CA")
    own.write_ca(secrets / "ca.crt")
    (secrets / "ca.key").write_bytes(own.key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))  # fmt: skip
    kept = digests(secrets)
    r = kube_secrets(secrets)
    assert r.returncode == 0, r.stderr
    assert "kept ca.crt, ca.key" in r.stdout and {k: digests(secrets)[k] for k in kept} == kept
    cert = x509.load_pem_x509_certificate((secrets / "tls.crt").read_bytes())
    assert signed_by(cert, own.cert)
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)


@pytest.mark.parametrize("where", ["a-file", "no-such-parent/secrets"])
def test_a_directory_it_cannot_make_is_one_line_and_exit_2(tmp_path: Path, where: str) -> None:
    (tmp_path / "a-file").write_text("")
    r = kube_secrets(tmp_path / where)
    if where == "a-file":
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "a-file" in r.stderr
    else:  # parents are made, as mkdir -p
        assert r.returncode == 0 and (tmp_path / where / "tls.crt").exists()
