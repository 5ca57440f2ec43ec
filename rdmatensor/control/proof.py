"""Proof of the job token without sending it: every call carries an HMAC, keyed
by the token, of its purpose (the method), the time, the sender's id and call
number, and a digest of its body. A listener on the wire learns neither the
token nor a call it can replay to the same receiver: each receiver refuses a
(sender, number) it has taken, a number too far behind the sender's latest,
and a time outside WINDOW (the hosts' clocks must agree within it).

Every reply proves the token too (`answer`): an HMAC of the call's own proof
and the reply's digest. So whatever listens at a peer's address without the
token (a process that took the port of a rank that died, or never started)
cannot answer as that peer, and a reply cannot be moved to another call."""
from __future__ import annotations

import hashlib
import hmac
import itertools
import secrets
import threading
import time

from ..errors import AuthenticationError

WINDOW = 300.0            # seconds a proof is good for, either side of the receiver's clock
BEHIND = 4096             # call numbers a sender's calls may arrive out of order by
UNBOUND = "-"             # the body's digest where a method's body is not bound (the grpc baseline's Push)


def digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _mac(token: str, purpose: str, stamp: str, nonce: str, body_digest: str) -> str:
    return hmac.new(token.encode(), f"{purpose}\n{stamp}\n{nonce}\n{body_digest}".encode(),
                    hashlib.sha256).hexdigest()


def answer(token: str, proof: str, body_digest: str) -> str:
    """The proof a reply carries: the token's HMAC of the call's proof and the reply's digest."""
    return hmac.new(token.encode(), f"reply\n{proof}\n{body_digest}".encode(), hashlib.sha256).hexdigest()


def check_answer(token: str, proof: str, body_digest: str, given: str | None) -> None:
    """AuthenticationError unless `given` is the reply's proof for the call that carried `proof`."""
    if not given or not hmac.compare_digest(given.encode(), answer(token, proof, body_digest).encode()):
        raise AuthenticationError("a reply that does not prove the job token: something other than the peer "
                                  "answers at its address")


class Signer:
    """One sender: its id, drawn once, and its calls numbered 1, 2, 3..."""

    def __init__(self, token: str):
        self._token, self._id, self._numbers = token, secrets.token_hex(8), itertools.count(1)

    def sign(self, purpose: str, body_digest: str) -> str:
        """The proof for one call: 'milliseconds.sender-number.digest.mac'."""
        stamp, nonce = str(int(time.time() * 1000)), f"{self._id}-{next(self._numbers)}"
        return f"{stamp}.{nonce}.{body_digest}.{_mac(self._token, purpose, stamp, nonce, body_digest)}"


class Verifier:
    """One receiver: checks proofs, and remembers which calls of each sender it took."""

    def __init__(self, token: str, window: float = WINDOW):
        self._token, self.window = token, window
        self._senders: dict[str, list] = {}        # sender -> [latest number, numbers taken, last heard]
        self._lock = threading.Lock()

    def check(self, purpose: str, proof: str) -> str:
        """The body digest the proof binds (UNBOUND for none); AuthenticationError for a
        proof that is malformed, forged, out of its time window, or taken before."""
        parts = proof.split(".")
        if len(parts) != 4 or not parts[0].isdigit():
            raise AuthenticationError("wrong or missing rdmatensor token")
        stamp, nonce, body_digest, mac = parts
        if not hmac.compare_digest(mac.encode(), _mac(self._token, purpose, stamp, nonce, body_digest).encode()):
            raise AuthenticationError("wrong or missing rdmatensor token")
        skew = abs(time.time() - int(stamp) / 1000)
        if skew > self.window:
            raise AuthenticationError(f"a proof of the job token {skew:.0f} s away from this host's clock "
                                      f"(more than {self.window:g} s: are the hosts' clocks set?)")
        sender, _, number = nonce.rpartition("-")
        if not number.isdigit():
            raise AuthenticationError("wrong or missing rdmatensor token")
        self._take(sender, int(number))
        return body_digest

    def _take(self, sender: str, number: int) -> None:
        now = time.monotonic()
        with self._lock:
            state = self._senders.get(sender)
            if state is None:
                if len(self._senders) > 1024:        # senders not heard from within the window go
                    self._senders = {s: v for s, v in self._senders.items() if now - v[2] < 2 * self.window}
                state = self._senders[sender] = [number, set(), now]
            latest, taken, _ = state
            if number in taken or number <= latest - BEHIND:
                raise AuthenticationError("a replayed call (this sender's call was taken before)")
            taken.add(number)
            state[2] = now
            if number > latest:
                state[0] = number
                if len(taken) > 2 * BEHIND:
                    state[1] = {n for n in taken if n > number - BEHIND}
