"""Flag: a threading.Event that costs next to nothing to set or clear while
nobody sleeps on it.

Every tensor sets and clears two of them (a slot's arrival, a credit), and
waiting threads mostly poll them from a provider's wait_for() rather than
sleep in wait(); Event takes its lock on every set() and clear(). A Flag
takes it only to sleep, and set() only when someone sleeps. No wake-up is
lost: a sleeper counts itself before its last look at the flag, and set()
stores the flag before it looks at the count (the interpreter lock orders
the two, as it does every step of Python code).

set, clear and is_set are compiled (`_slots.c`, see slots.py) where it is
built; the Python ones below do the same otherwise.
"""
from __future__ import annotations

import threading

from .slots import compiled


class _Flag:
    __slots__ = ("_flag", "_sleepers")

    def __init__(self, value: bool = False):
        self._flag = value
        self._sleepers = 0

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        self._flag = True
        if self._sleepers:
            self._wake()

    def clear(self) -> None:
        self._flag = False


class Flag(compiled.Flag if compiled else _Flag):
    __slots__ = ("_cond",)

    def __init__(self, value: bool = False):
        super().__init__(value)
        self._cond = threading.Condition(threading.Lock())

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        if self.is_set():
            return True
        with self._cond:
            self._sleepers += 1
            try:
                return self._cond.wait_for(self.is_set, timeout)
            finally:
                self._sleepers -= 1
