"""Per-rank identity on the control plane: pair credentials.

The job token only says "a member of this job". Which member is proven by a
secret of the pair: the lower rank draws it and sends it with its Exchange
(once per pair, ever), and every later per-rank call between the two (Grow,
Barrier, Bye, Ping, Push) carries it. A token holder without it cannot act as
another rank.
"""
from __future__ import annotations

import hmac
import secrets
import threading

from ..errors import AuthenticationError, BadRequest, DuplicateExchange

MIN_SECRET = 32     # characters


class PairCredentials:
    def __init__(self):
        self._secrets: dict[int, str] = {}
        self._lock = threading.Lock()

    def draw(self, peer: int) -> str:
        """A fresh secret for the pair with `peer` (this side makes the Exchange)."""
        secret = secrets.token_hex(MIN_SECRET // 2)
        with self._lock:
            self._secrets[peer] = secret
        return secret

    def claim(self, peer: int, secret: str) -> None:
        """Take the secret `peer` sent with its Exchange; a pair exchanges once."""
        if len(secret) < MIN_SECRET:
            raise BadRequest(f"a pair secret of at least {MIN_SECRET} characters is required", peer=peer)
        with self._lock:
            if peer in self._secrets:
                raise DuplicateExchange(f"rank {peer} already exchanged", peer=peer)
            self._secrets[peer] = secret

    def secret(self, peer: int) -> str:
        return self._secrets.get(peer, "")

    def peers(self) -> list[int]:
        """Every peer this rank shares a credential with (those it ever reached)."""
        with self._lock:
            return sorted(self._secrets)

    def check(self, peer: int, secret: str) -> None:
        """Only the rank that exchanged with us may act as that rank."""
        want = self._secrets.get(peer)
        if not want or not hmac.compare_digest(want.encode(), secret.encode()):
            raise AuthenticationError(f"not rank {peer}'s pair credential", peer=peer)
