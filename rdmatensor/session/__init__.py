"""One rank's end of an rdmatensor job, split along its seams:

    facade.py    connect() and Session: builds the parts, runs setup, delegates
    context.py   what every part shares: rank, plan, channels, control clients, counters
    exchange.py  setup: arenas, channels, slots; one Exchange per pair; protobuf converters
    credits.py   slot state and credits: DATA and CREDIT immediates, where a credit is returned
    slots.py     a receive slot's state machine, compiled where built (_slots.c), else in Python
    wire.py      a slot's bytes: dynamic shape header and checksum trailer, encoded and parsed
    send.py      the sender's data path (staging, posted writes)
    recv.py      the receiver's data path and Received, the zero-copy view
    growth.py    dynamic growth, both sides of Grow
    barrier.py   named barriers, coordinated by the lowest rank
    liveness.py  heartbeats, goodbye, sticky errors: where a peer is declared lost
    flag.py      an Event that costs next to nothing to set or clear while nobody waits

Setup (once, before the first step) costs one control call per peer pair;
from then on a static tensor costs one one-sided write: no control call, no
serialization, no handshake.
"""
from .facade import Session, connect
from .recv import Received

__all__ = ["Session", "Received", "connect"]
