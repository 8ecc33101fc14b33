"""A test service-account issuer: RSA keys, their JWKS, and projected tokens
shaped as the kubelet asks the API server for them (Kubernetes 1.30+)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import rsa

ISSUER = "https://kubernetes.default.svc.cluster.local"


class TestIssuer:
    __test__ = False  # not a pytest class

    def __init__(self, kid: str = "k1", issuer: str = ISSUER) -> None:
        self.kid, self.issuer = kid, issuer
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)

    def jwks(self) -> dict[str, Any]:
        jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(self.key.public_key()))
        jwk.update(kid=self.kid, use="sig", alg="RS256")
        return {"keys": [jwk]}

    def claims(self, node: str | None, namespace: str = "nodesampler", account: str = "nodesampler-agent",
               audience: str = "nodesampler", ttl: float = 3600, now: float | None = None,
               issued_in: float = 0.0) -> dict[str, Any]:
        """`issued_in`: seconds after the moment of signing that the token says
        it was issued (a clock ahead), read when it is signed, not when a test
        is collected."""
        now = (time.time() if now is None else now) + issued_in
        ident: dict[str, Any] = {
            "namespace": namespace,
            "serviceaccount": {"name": account, "uid": str(uuid.uuid4())},
            "pod": {"name": "nodesampler-agent-abcde", "uid": str(uuid.uuid4())},
        }
        if node is not None:
            ident["node"] = {"name": node, "uid": str(uuid.uuid4())}
        return {"aud": [audience], "exp": int(now + ttl), "iat": int(now), "nbf": int(now), "iss": self.issuer,
                "jti": str(uuid.uuid4()), "kubernetes.io": ident,
                "sub": f"system:serviceaccount:{namespace}:{account}"}  # fmt: skip

    def sign(self, claims: dict[str, Any]) -> str:
        return jwt.encode(claims, self.key, algorithm="RS256", headers={"kid": self.kid})

    def token(self, node: str | None, **kw: Any) -> str:
        return self.sign(self.claims(node, **kw))
