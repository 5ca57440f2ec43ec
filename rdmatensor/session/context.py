"""What every part of one rank's session shares: who it is, the plan, the
provider of each pair, one channel and one control client per peer, the
arenas it owns, and its counters."""
from __future__ import annotations

import threading
from typing import Callable, Mapping

from ..control.auth import PairCredentials
from ..control.service import ControlClient, TlsConfig
from ..memory import Arena
from ..plan import Plan, TensorSpec
from ..errors import UnknownTensor
from ..providers.contract import Channel

# copies by purpose, each with its bytes: pieces gathered into staging, a whole array copied
# into staging (memory verbs cannot write from), a value framed (dynamic shape or checksum)
COPY_PURPOSES = ("gather", "array", "frame")
COUNTERS = ("copies", "dynamic", "fallbacks", "grows", "waits", "corrupt", "bytes_copied", "pings",
            *(f"copies_{p}" for p in COPY_PURPOSES))


class Counters:
    """The numbers stats() reports, safe to bump from any thread (writes,
    receives and their bytes are counted by each slot: Credits.traffic())."""

    def __init__(self):
        self._lock = threading.Lock()
        self._values = dict.fromkeys(COUNTERS, 0)

    def add(self, *names: str, **amounts: int) -> None:
        with self._lock:
            for n in names:
                self._values[n] += 1
            for n, v in amounts.items():
                self._values[n] += v

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._values)


def count_copy(counters: Counters, purpose: str, nbytes: int) -> None:
    """Count one copy of `nbytes` made for `purpose` (COPY_PURPOSES)."""
    counters.add("copies", f"copies_{purpose}", bytes_copied=nbytes)


class SessionContext:
    def __init__(self, rank: int, peers: Mapping[int, str], plan: Plan,
                 provider_classes: Mapping[int, type[Channel]], token: str, tls: TlsConfig | None, timeout: float):
        self.rank, self.plan, self.timeout = rank, plan, timeout
        self.peers = dict(peers)                  # rank -> control address "host:port"
        self.token, self.tls = token, tls
        self.provider_classes = dict(provider_classes)    # peer -> the provider of that pair
        self.channels: dict[int, Channel] = {}
        self.arenas: list[Arena] = []
        self.credentials = PairCredentials()
        self.counters = Counters()
        self.closed = False
        self.abort: Callable[[], None] | None = None    # while setting up: raises to give it up (connect's abort)
        self._clients: dict[int, ControlClient] = {}
        self._clients_lock = threading.Lock()

    def host(self, rank: int) -> str:
        return self.peers[rank].rsplit(":", 1)[0].strip("[]")

    def provider_name(self, peer: int) -> str:
        """The provider of the pair with `peer` ("" for a peer this rank shares no tensor with)."""
        cls = self.provider_classes.get(peer)
        return cls.name if cls else ""

    def arena(self, size: int, shared: bool = False) -> Arena:
        """A new arena this session owns (closed with it)."""
        arena = Arena(size, shared=shared)
        self.arenas.append(arena)
        return arena

    def spec(self, name: str) -> TensorSpec:
        spec = self.plan.specs.get(name)
        if spec is None:
            raise UnknownTensor(f"tensor {name!r} is not in the plan", tensor=name)
        return spec

    # -- control calls ----------------------------------------------------
    def client(self, peer: int) -> ControlClient:
        with self._clients_lock:
            if peer not in self._clients:
                self._clients[peer] = ControlClient(self.peers[peer], self.token, self.tls, peer=peer)
            return self._clients[peer]

    def call(self, peer: int, method: str, request, timeout: float, wait_for_ready: bool = False):
        """Call `method` ("Exchange", "Grow", ...) on `peer`'s control server."""
        client = self.client(peer)
        return client.call(getattr(client.control, method), request, timeout=timeout,
                           wait_for_ready=wait_for_ready, abort=self.abort)

    def check_abort(self) -> None:
        if self.abort is not None:
            self.abort()

    def control_calls(self) -> int:
        with self._clients_lock:
            return sum(c.calls for c in self._clients.values())

    def close_clients(self) -> None:
        with self._clients_lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()

    # -- waiting ----------------------------------------------------------
    def wait(self, event: threading.Event, peer: int, timeout: float) -> bool:
        """Wait for `event` the way this provider waits best (see Channel.wait_for)."""
        return event.is_set() or self.channels[peer].wait_for(event, timeout)
