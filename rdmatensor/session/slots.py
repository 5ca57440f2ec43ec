"""A receive slot's state machine, compiled where it is built (`_slots.c`,
by `make setup`), else in Python here: one contract, two builds, like the
verbs endpoints. RDMATENSOR_SLOTS=python, read at import, forces Python.

    EMPTY --arrive()--> FULL --take()--> HELD --release()--> EMPTY
    FULL --release()--> EMPTY          (a value rejected on receipt)
    any  --wake()-->    same state, and every waiter is woken for good
                        (the peer was lost, or the session closed)

arrive() outside EMPTY changes nothing and says False (credits.py raises
CreditViolation). Memory is replaced (growth) only while EMPTY. The compiled
module also has Immediates, a channel's on_imm that moves a slot on a valid
DATA or CREDIT immediate without leaving C and hands anything else to the
Python on_imm (Credits.on_imm), which enforces the rules; and Hop, the
session's send(), recv() and release compiled for their common case (a
static tensor from its staging through its prepared write, a value handed
over as its view, a credit owed to the next write), which hands everything
else, waits for a credit and every error included, to the Python path
(send.py, recv.py), so both builds keep one contract."""
from __future__ import annotations

import threading

from .. import native

SLOTS_ENV = "RDMATENSOR_SLOTS"
_built, BUILD_ERROR = native.load("rdmatensor.session._slots")
compiled = _built if native.chosen(_built, SLOTS_ENV) else None


class _SlotState:
    EMPTY, FULL, HELD = "empty", "full", "held"

    def __init__(self, memory, arrived):
        self.memory, self.arrived = memory, arrived
        self.view = None             # the read-only tensor in memory, where it never moves
        self.grown = None            # (region id, arena) once grown
        self.state = self.EMPTY
        self.tag = 0                 # the sender's tag of the value in the slot
        self.recvs = self.bytes_received = 0     # values handed out (each Received counts one), their bytes
        self._woken = False
        self._lock = threading.Lock()

    def arrive(self, tag: int) -> bool:
        with self._lock:
            if self.state != self.EMPTY:
                return False
            self.tag = tag
            self.state = self.FULL
            self.arrived.set()
            return True

    def take(self) -> bool:
        """FULL -> HELD; False when there is no value to take (woken by a failure)."""
        with self._lock:
            if self.state != self.FULL:
                return False
            self.state = self.HELD
            return True

    def release(self) -> None:
        with self._lock:
            self.state = self.EMPTY
            if not self._woken:          # a loss must keep waking later waiters
                self.arrived.clear()

    def wake(self) -> None:
        with self._lock:
            self._woken = True
            self.arrived.set()

    def replace(self, grown, memory) -> tuple[bool, object]:
        """New memory, only while EMPTY: (True, the `grown` it replaces), or
        (False, None) with nothing changed."""
        with self._lock:
            if self.state != self.EMPTY:
                return False, None
            old, self.grown, self.memory, self.view = self.grown, grown, memory, None
            return True, old


SlotState = compiled.SlotState if compiled else _SlotState
