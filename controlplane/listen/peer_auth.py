"""How replicas prove themselves to each other: a challenge bound to each
request, HMAC'd by each side under a key made from the cluster secret.

A fixed bearer (what peers first showed) is a credential: whoever answers
at a `--peer` address once, or reads one plain-http request, holds it for
good, and with it every peer route and any user's rights. Here nothing
sent can be used again, elsewhere or later:

1. The caller asks the replica it means for a challenge
   (`GET /v1/peer/challenge`, open like `/health`): `MS.RANDOM.MAC`, made
   on the answerer's clock under a key of its own process, good for
   `CHALLENGE_S` and once.
2. It sends the request with `X-Nodesampler-Peer: from=ID; challenge=C;
   mac=M`, M an HMAC of the method, the target (the `--peer` URL it sends
   to, as its own list names it), the path and query, the challenge, its
   own id, and the user and viewer it forwards for. The answerer checks
   that the challenge is its own, fresh and unused, that the target is
   itself (a URL its own polls reached it by; before its first, the `Host`
   the request names), and the MAC. A request read on the way is refused
   at any other replica (another target), at this one later (the challenge
   is spent) and with another path, method or user (another MAC).
3. Its answer carries `X-Nodesampler-Peer-Proof`, an HMAC of the challenge,
   the status and (for answers read whole) the body's SHA-256: the caller
   uses no answer a stranger made, so nobody who lacks the secret can say
   it holds a node, and no page a stranger wrote reaches an operator.

The challenge is the only thing anyone may ask for without the secret: its
cost is one HMAC, and no state is kept for it (the used ones are
remembered only after a request that verified spent them).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

CONTEXT = b"nodesampler peer request v2"
HEADER = "X-Nodesampler-Peer"
PROOF = "X-Nodesampler-Peer-Proof"
CHALLENGE_PATH = "/v1/peer/challenge"
CHALLENGE_S = 30.0  # a challenge is good this long on its maker's clock: asked for, then used at once
MAX_SPENT = 200_000  # challenges remembered as spent: a peer's requests of CHALLENGE_S, with room
MAX_FIELD = 512  # any one field of the header


def peer_key(secret: bytes) -> bytes:
    """The key every replica sharing `secret` signs with (another context than a node token's)."""
    return hmac.new(secret, CONTEXT, hashlib.sha256).digest()


def request_mac(key: bytes, method: str, target: str, path_qs: str, challenge: str, sender: str, user: str,
                viewer: str) -> str:  # fmt: skip
    fields = ("request", method.upper(), target.rstrip("/"), path_qs, challenge, sender, user, viewer)
    return hmac.new(key, "\n".join(fields).encode("utf-8", "surrogateescape"), hashlib.sha256).hexdigest()


def answer_proof(key: bytes, challenge: str, status: int, body: bytes | None) -> str:
    """The answerer's proof: over the body too when the answer is read whole (None: a stream)."""
    digest = "-" if body is None else hashlib.sha256(body).hexdigest()
    return hmac.new(key, f"answer\n{challenge}\n{status}\n{digest}".encode(), hashlib.sha256).hexdigest()


def header_value(sender: str, challenge: str, mac: str) -> str:
    return f"from={sender}; challenge={challenge}; mac={mac}"


def parse_header(value: str) -> dict[str, str] | None:
    """The header's fields, or None when it is not one."""
    fields: dict[str, str] = {}
    for part in value.split(";"):
        name, sep, text = part.strip().partition("=")
        if not sep or name not in ("from", "challenge", "mac") or name in fields or len(text) > MAX_FIELD:
            return None
        fields[name] = text
    return fields if len(fields) == 3 else None


@dataclass(frozen=True)
class Verified:
    sender: str  # the replica's id that sent it
    challenge: str
    target: str


class PeerAuth:
    """One replica's side of it: its challenges, the ones spent, its own URLs, and the shared key."""

    def __init__(self, secret: bytes, instance: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.key = peer_key(secret)
        self.instance = instance
        self.clock = clock
        self._own_key = secrets.token_bytes(32)  # challenges are this process's alone
        self._spent: OrderedDict[str, float] = OrderedDict()  # challenge -> when it stops being good
        self.own_urls: set[str] = set()  # the targets its own polls reached it by
        self.candidates: list[str] = []  # the --peer URLs (set by controlplane/fleet/peers.py): one may be this one

    # --- the answerer -------------------------------------------------------------------

    def challenge(self) -> str:
        made = f"{int(self.clock() * 1000)}.{secrets.token_hex(16)}"  # milliseconds on this replica's clock
        return f"{made}.{hmac.new(self._own_key, made.encode(), hashlib.sha256).hexdigest()[:32]}"

    def _challenge_good(self, challenge: str, now: float) -> bool:
        made, _, mac = challenge.rpartition(".")
        expected = hmac.new(self._own_key, made.encode("utf-8", "surrogateescape"), hashlib.sha256).hexdigest()[:32]
        if not made or not hmac.compare_digest(expected.encode(), mac.encode("utf-8", "surrogateescape")):
            return False
        try:
            at = int(made.partition(".")[0]) / 1000
        except ValueError:
            return False
        return at <= now <= at + CHALLENGE_S

    def verify(self, header: str | None, method: str, path_qs: str, host: str, user: str,
               viewer: str) -> Verified | str:  # fmt: skip
        """The request's sender, or why it is refused. `host` (the request's
        Host) stands for this replica's URL until its own polls name it."""
        fields = parse_header(header or "")
        if fields is None:
            return f"a peer's signed request is needed ({HEADER})"
        now = self.clock()
        challenge, sender, mac = fields["challenge"], fields["from"], fields["mac"]
        if not self._challenge_good(challenge, now):
            return "not a challenge of this replica's, or an old one"
        if challenge in self._spent:
            return "a challenge already used"
        # The target, which is in the MAC, must be this replica: a URL its own polls reached
        # it by; before the first (or when it is not in its own --peer list), its Host.
        targets = list(self.own_urls) or [f"http://{host}", f"https://{host}"]
        if sender == self.instance:  # itself: which of the --peer URLs it meant is learnt here
            targets += [url for url in self.candidates if url not in self.own_urls]
        for target in targets:
            expected = request_mac(self.key, method, target, path_qs, challenge, sender, user, viewer)
            if hmac.compare_digest(expected.encode(), mac.encode("utf-8", "surrogateescape")):
                break
        else:
            return "its MAC does not verify at this replica (another target, path, user or secret)"
        if sender == self.instance and target in self.candidates:
            self.own_urls.add(target)
        self._spend(challenge, now)
        return Verified(sender, challenge, target)

    def _spend(self, challenge: str, now: float) -> None:
        while self._spent and (next(iter(self._spent.values())) < now or len(self._spent) >= MAX_SPENT):
            self._spent.popitem(last=False)
        self._spent[challenge] = now + CHALLENGE_S + 1

    def prove(self, challenge: str, status: int, body: bytes | None) -> str:
        return answer_proof(self.key, challenge, status, body)

    # --- the caller ---------------------------------------------------------------------

    def sign(self, method: str, target: str, path_qs: str, challenge: str, user: str = "", viewer: str = "") -> str:
        return header_value(self.instance, challenge,
                            request_mac(self.key, method, target, path_qs, challenge, self.instance, user, viewer))

    def proven(self, proof: str | None, challenge: str, status: int, body: bytes | None) -> bool:
        """Whether the answer came from a replica that holds the secret (and, with `body`, is the one it sent)."""
        return proof is not None and hmac.compare_digest(
            answer_proof(self.key, challenge, status, body).encode(), proof.encode("utf-8", "surrogateescape"))
