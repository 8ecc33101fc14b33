"""The rules a projected service-account token must pass, each broken on its
own; the token cache; key rotation; HMAC tokens beside JWTs."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import jwt
import pytest
from aiohttp import web

from controlplane.ingest import tokens
from controlplane.ingest.node_identity import (
    REFETCH_EVERY_S,
    REREAD_EVERY_S,
    Forbidden,
    JwksSource,
    NodeAuthenticator,
    ServiceAccountRules,
    ServiceAccountVerifier,
    Unauthenticated,
    looks_like_jwt,
)
from tests.issuer import ISSUER, TestIssuer

SECRET = b"a cluster secret of some length"


@pytest.fixture(scope="module")
def issuer() -> TestIssuer:
    return TestIssuer()


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def verifier_for(issuer: TestIssuer, tmp_path: Path, clock: Clock | None = None) -> ServiceAccountVerifier:
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps(issuer.jwks()))
    return ServiceAccountVerifier(JwksSource(str(path), clock=clock or Clock()), ServiceAccountRules(ISSUER))


async def test_a_good_token_names_its_node(issuer: TestIssuer, tmp_path: Path) -> None:
    v = verifier_for(issuer, tmp_path)
    assert await v.node(issuer.token("gpu-17")) == "gpu-17"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"ttl": -120}, "expired"),
        ({"issued_in": 600}, "not yet valid"),  # not time.time() + 600: that is read at collection
        ({"audience": "kubernetes"}, "(?i)audience"),
        ({"namespace": "default"}, "service account"),
        ({"account": "default"}, "service account"),
    ],
)
async def test_each_claim_wrong_on_its_own_is_401(issuer: TestIssuer, tmp_path: Path, change: dict[str, object],
                                                 reason: str) -> None:  # fmt: skip
    v = verifier_for(issuer, tmp_path)
    with pytest.raises(Unauthenticated, match=reason):
        await v.node(issuer.token("gpu-17", **change))


async def test_small_clock_skew_is_tolerated(issuer: TestIssuer, tmp_path: Path) -> None:
    v = verifier_for(issuer, tmp_path)
    assert await v.node(issuer.token("gpu-17", ttl=-10)) == "gpu-17"  # expired 10 s ago: within the leeway
    assert await v.node(issuer.token("gpu-17", issued_in=10)) == "gpu-17"


async def test_another_issuer_is_401(issuer: TestIssuer, tmp_path: Path) -> None:
    v = verifier_for(issuer, tmp_path)
    claims = issuer.claims("gpu-17")
    claims["iss"] = "https://elsewhere.example"
    with pytest.raises(Unauthenticated, match="(?i)issuer"):
        await v.node(issuer.sign(claims))


async def test_subject_must_match_the_kubernetes_claims(issuer: TestIssuer, tmp_path: Path) -> None:
    v = verifier_for(issuer, tmp_path)
    claims = issuer.claims("gpu-17")
    claims["sub"] = "system:serviceaccount:default:default"  # the body says agent, the subject not
    with pytest.raises(Unauthenticated, match="service account"):
        await v.node(issuer.sign(claims))
    del claims["exp"]
    claims["sub"] = "system:serviceaccount:nodesampler:nodesampler-agent"
    with pytest.raises(Unauthenticated, match="exp"):
        await v.node(issuer.sign(claims))


async def test_unknown_key_tampered_and_unsigned_tokens_are_401(issuer: TestIssuer, tmp_path: Path) -> None:
    v = verifier_for(issuer, tmp_path)
    stranger = TestIssuer(kid="k1")  # the same key id, another key
    with pytest.raises(Unauthenticated, match="Signature"):
        await v.node(stranger.token("gpu-17"))
    with pytest.raises(Unauthenticated, match="unknown key"):
        await v.node(TestIssuer(kid="k9").token("gpu-17"))
    good = issuer.token("gpu-17")
    head, body, sig = good.split(".")
    claims = json.loads(jwt.utils.base64url_decode(body))
    claims["kubernetes.io"]["node"]["name"] = "gpu-18"
    forged = ".".join([head, jwt.utils.base64url_encode(json.dumps(claims).encode()).decode(), sig])
    with pytest.raises(Unauthenticated, match="Signature"):
        await v.node(forged)
    unsigned = jwt.encode(issuer.claims("gpu-17"), "", algorithm="none", headers={"kid": "k1"})
    with pytest.raises(Unauthenticated):
        await v.node(unsigned)
    hs = jwt.encode(issuer.claims("gpu-17"), "k" * 32, algorithm="HS256", headers={"kid": "k1"})
    with pytest.raises(Unauthenticated, match="alg"):
        await v.node(hs)  # a public key used as an HMAC secret: the classic confusion
    with pytest.raises(Unauthenticated, match="malformed"):
        await v.node("eyJ.not.ajwt")


async def test_a_token_naming_no_node_is_403_with_the_reason(issuer: TestIssuer, tmp_path: Path) -> None:
    v = verifier_for(issuer, tmp_path)
    with pytest.raises(Forbidden, match="1.30"):
        await v.node(issuer.token(None))
    with pytest.raises(Forbidden, match="not a node name"):
        await v.node(issuer.token("bad name/with slash"))


async def test_a_verified_token_is_cached_until_it_expires(issuer: TestIssuer, tmp_path: Path) -> None:
    clock = Clock()
    clock.t = time.time()
    v = verifier_for(issuer, tmp_path)
    v._clock = clock
    token = issuer.token("gpu-17", ttl=600, now=clock.t)
    assert await v.node(token) == "gpu-17"
    verified_again: list[str] = []
    decode = v._decode

    def counting(t: str, k: Any) -> dict[str, Any]:
        verified_again.append(t)
        return decode(t, k)

    v._decode = counting  # type: ignore[method-assign,assignment]
    v.keys._last_try = 1e18  # and a cache hit fetches nothing
    assert await v.node(token) == "gpu-17" and verified_again == []  # no signature checked again
    clock.t += 600 + 31  # past exp and the leeway: verified afresh (here the signature still holds)
    assert await v.node(token) == "gpu-17" and verified_again == [token]


async def test_a_rotated_key_is_fetched_again_at_most_once_a_minute(tmp_path: Path) -> None:
    old, new = TestIssuer(kid="old"), TestIssuer(kid="new")
    doc = {"keys": old.jwks()["keys"]}
    fetches = []

    async def fetch() -> bytes:
        fetches.append(1)
        return json.dumps(doc).encode()

    clock = Clock()
    v = ServiceAccountVerifier(JwksSource("https://issuer.example/jwks", clock=clock, fetch=fetch),
                               ServiceAccountRules(ISSUER))  # fmt: skip
    assert await v.node(old.token("n1")) == "n1"
    assert len(fetches) == 1
    doc["keys"] = old.jwks()["keys"] + new.jwks()["keys"]  # the issuer rotates
    clock.t += REFETCH_EVERY_S
    assert await v.node(new.token("n1")) == "n1"  # unknown key id: fetched again
    assert len(fetches) == 2
    for _ in range(5):  # a flood of unknown key ids costs one fetch a minute
        with pytest.raises(Unauthenticated, match="unknown key"):
            await v.node(TestIssuer(kid="k-stranger").token("n1"))
    assert len(fetches) == 2


async def test_a_withdrawn_key_stops_verifying_within_the_reread_period(tmp_path: Path) -> None:
    """The cluster withdraws a key (it leaked): tokens it signed, even ones
    verified and cached before, are refused once the keys are read again,
    which happens in the background: no request waits for the issuer."""
    leaked, kept = TestIssuer(kid="leaked"), TestIssuer(kid="kept")
    doc = {"keys": leaked.jwks()["keys"] + kept.jwks()["keys"]}
    issuer_slow = asyncio.Event()
    issuer_slow.set()

    async def fetch() -> bytes:
        await issuer_slow.wait()
        return json.dumps(doc).encode()

    clock = Clock()
    v = ServiceAccountVerifier(JwksSource("https://issuer.example/jwks", clock=clock, fetch=fetch),
                               ServiceAccountRules(ISSUER))  # fmt: skip
    token = leaked.token("n1")
    assert await v.node(token) == "n1" and await v.node(kept.token("n2")) == "n2"
    doc["keys"] = kept.jwks()["keys"]  # withdrawn at the issuer
    clock.t += REREAD_EVERY_S - 1
    assert await v.node(token) == "n1"  # not yet read again
    clock.t += 1
    issuer_slow.clear()  # the issuer is slow to answer the re-read ...
    assert await asyncio.wait_for(v.node(token), 1) == "n1"  # ... and the request does not wait for it
    issuer_slow.set()
    await asyncio.sleep(0)
    while v.keys._rereading is not None and not v.keys._rereading.done():
        await asyncio.sleep(0.01)
    with pytest.raises(Unauthenticated, match="unknown key 'leaked'"):
        await v.node(token)
    assert await v.node(kept.token("n2")) == "n2"


async def test_keys_that_cannot_be_read_keep_the_last_good_ones(issuer: TestIssuer, tmp_path: Path) -> None:
    clock = Clock()
    v = verifier_for(issuer, tmp_path, clock)
    assert await v.node(issuer.token("n1")) == "n1"
    (tmp_path / "jwks.json").write_text("{not json")
    clock.t += REFETCH_EVERY_S
    assert await v.keys.refresh() is False
    assert await v.node(issuer.token("n2")) == "n2"
    assert JwksSource.parse(b'{"keys": [{"kty": "oct", "kid": "x", "use": "enc"}]}') == {}
    with pytest.raises(ValueError, match="JWKS"):
        JwksSource.parse(b'{"keys": 3}')


async def test_hmac_and_service_account_tokens_side_by_side(issuer: TestIssuer, tmp_path: Path) -> None:
    auth = NodeAuthenticator(SECRET, verifier_for(issuer, tmp_path))
    assert await auth.node(tokens.node_token(SECRET, "bare-metal-1")) == "bare-metal-1"
    assert await auth.node(tokens.node_token(SECRET, "eyJ.a")) == "eyJ.a"  # a name that starts like a JWT
    assert await auth.node(issuer.token("gpu-17")) == "gpu-17"
    with pytest.raises(Unauthenticated):
        await auth.node("gpu-17.0000")
    hmac_only = NodeAuthenticator(SECRET)
    with pytest.raises(Unauthenticated):
        await hmac_only.node(issuer.token("gpu-17"))
    assert looks_like_jwt(issuer.token("gpu-17")) and not looks_like_jwt(tokens.node_token(SECRET, "a.b"))
    with pytest.raises(ValueError):
        NodeAuthenticator()


async def test_jwks_from_a_url_with_the_pods_own_token(aiohttp_server: Any, issuer: TestIssuer,
                                                       tmp_path: Path) -> None:  # fmt: skip
    seen: list[str] = []

    async def jwks(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        if request.headers.get("Authorization") != "Bearer my-own-token":
            return web.json_response({"code": 401}, status=401)
        return web.json_response(issuer.jwks())

    app = web.Application()
    app.router.add_get("/openid/v1/jwks", jwks)
    server = await aiohttp_server(app)
    url = str(server.make_url("/openid/v1/jwks"))
    (tmp_path / "token").write_text("my-own-token\n")
    source = JwksSource(url, sa_dir=tmp_path)
    try:
        assert await source.refresh() and await source.key("k1") is not None
        assert seen == ["Bearer my-own-token"]
    finally:
        await source.close()
    anonymous = JwksSource(url, sa_dir=tmp_path / "elsewhere")  # no token mounted: refused, and said
    try:
        assert await anonymous.refresh() is False and await anonymous.key("k1") is None
    finally:
        await anonymous.close()
