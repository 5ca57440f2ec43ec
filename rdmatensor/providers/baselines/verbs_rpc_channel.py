"""verbs-rpc: a BASELINE, the RPC that RDMA-optimized libraries build, on the
same verbs device as `verbs`.

It exists to tell how much of rdmatensor's gain comes from one-sided writes
into preallocated buffers and how much from RDMA itself. It does what such
libraries do:

- two-sided SEND/RECV into the receiver's private, pre-posted, pre-registered
  buffers (the sender never learns an address, and the receiver's CPU takes
  every message);
- a message larger than one buffer goes in chunks, the first one framed with
  the message's length;
- the tensor is serialized into a protobuf message (as gRPC does), the
  receiver copies each chunk out of its private buffer, parses the message and
  copies the payload into the destination slot.

The slot, key and bounds checks are the same as every provider's (the
destination is named in the message and checked before the copy).
"""
from __future__ import annotations

import struct
import threading

import numpy as np

from ...control.service import pb
from ...errors import RefusedWrite
from ...memory import Arena
from ..contract import Capabilities, Channel
from ..verbs.rc import LOCAL_ONLY, READ_ONLY, RECV_BATCH
from ..verbs.channel import VerbsChannel

CHUNK = 256 << 10         # one private receive (and send) buffer
RECV_BUFFERS = 32         # pre-posted receives: 8 MiB in flight towards this side
SEND_BUFFERS = 16
FRAME = struct.Struct("<Q")   # a message's total length, ahead of its first chunk
MAX_OVERHEAD = 1024           # protobuf framing beyond the payload


class VerbsRpcChannel(VerbsChannel):
    name = "verbs-rpc"
    # Writes go from any array (serialized, then copied into a private send
    # buffer) and are complete when write() returns.
    capabilities = Capabilities()

    def __init__(self, *args, max_incoming: int = 128, **kwargs):
        # Every message, credits included, takes one of the private receive buffers.
        super().__init__(*args, max_incoming=RECV_BUFFERS - RECV_BATCH, **kwargs)
        self.copies = 0
        self._inbox, self._outbox = Arena(RECV_BUFFERS * CHUNK), Arena(SEND_BUFFERS * CHUNK)
        self.ep.register(self._inbox.buf, LOCAL_ONLY)
        self.ep.register(self._outbox.buf, READ_ONLY)
        self._send_done: list = [None] * SEND_BUFFERS   # the number of the last send from each buffer
        self._next_send = 0
        self._send_lock = threading.Lock()
        self._message: bytearray | None = None          # the message being reassembled
        self._filled = 0

    # Regions are not registered for remote access: only this side writes into them.
    expose = Channel.expose
    unexpose = Channel.unexpose
    register_source = Channel.register_source
    deregister_source = Channel.deregister_source
    writes_from = Channel.writes_from
    prepare_write = Channel.prepare_write           # a write is a message here: write() sends it
    credit_sink = Channel.credit_sink               # a credit is a message here: notify_later() sends it
    waiter = Channel.waiter                         # a completion is a message to parse here: _take() does it

    def _post_receives(self) -> None:
        for index in range(RECV_BUFFERS):
            self._post_receive(index)

    def _post_receive(self, index: int) -> None:
        self.ep.post_recv_into(self._inbox.buf[index * CHUNK:(index + 1) * CHUNK], index)

    # -- receiving --------------------------------------------------------
    def _take(self, spin: float) -> tuple:
        """As the verbs channel's, but each receive carries a chunk of a message."""
        done, last = self.ep.poll(32, spin), 0
        for wr_id, status, is_receive, imm, nbytes in done:
            if status:
                return len(done), last, (wr_id, status, is_receive)
            if is_receive:
                self._received(wr_id, nbytes, imm)
            else:
                last = wr_id
        return len(done), last, None

    def _received(self, index: int, length: int, imm: int) -> None:
        """One chunk landed in private buffer `index`: copy it out, re-post the buffer."""
        chunk = self._inbox.buf[index * CHUNK:index * CHUNK + length]
        if self._message is None:
            if length < FRAME.size:
                raise RefusedWrite(f"peer {self.peer} sent a {length}-byte message without a frame",
                                   peer=self.peer)
            total = FRAME.unpack_from(chunk)[0]
            limit = max((arena.size for arena, _ in self.local.values()), default=0) + MAX_OVERHEAD
            if total > limit:
                raise RefusedWrite(f"peer {self.peer} announced a {total}-byte message; the "
                                     f"largest this side takes is {limit}", peer=self.peer)
            self._message, self._filled, chunk = bytearray(total), 0, chunk[FRAME.size:]
        end = self._filled + len(chunk)
        if end > len(self._message):
            raise RefusedWrite(f"peer {self.peer} sent more than the {len(self._message)} bytes "
                                 f"it announced", peer=self.peer)
        self._message[self._filled:end] = memoryview(chunk)      # out of the private buffer
        self._filled = end
        self._post_receive(index)
        if self._filled == len(self._message):
            message, self._message = self._message, None
            self._deliver(message)

    def _deliver(self, message: bytearray) -> None:
        try:
            request = pb.PushRequest.FromString(bytes(message))    # deserialize (a copy)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the peer's fault
            raise RefusedWrite(f"peer {self.peer} sent a malformed message: {exc}", peer=self.peer) from exc
        if request.payload:
            length = len(request.payload)
            arena = self.check_local(request.region_id, request.key, request.offset, length)
            arena.buf[request.offset:request.offset + length] = np.frombuffer(request.payload, np.uint8)
            self.copies += 3      # out of the private buffers, deserialized, into the slot
        self.on_imm(request.imm)

    # -- sending ----------------------------------------------------------
    write_many = Channel.write_many       # one RPC per write, as such libraries send them

    def write(self, region_id: int, offset: int, src: np.ndarray, imm: int) -> None:
        desc = self.check_remote(region_id, offset, src.nbytes)
        message = pb.PushRequest(rank=self.rank, region_id=region_id, key=desc["key"], offset=offset,
                                 payload=src.tobytes(), imm=imm).SerializeToString()
        self.copies += 2 if src.nbytes else 0          # into bytes, then into the serialized message
        self._send_message(message, copied=bool(src.nbytes))

    def notify(self, imm: int) -> None:
        self._send_message(pb.PushRequest(rank=self.rank, region_id=-1, imm=imm).SerializeToString())

    def notify_later(self, imm: int) -> None:
        self.notify(imm)      # a credit is a message here, never a raw immediate to owe

    def _send_message(self, message: bytes, copied: bool = False) -> None:
        """Frame `message` and SEND it in chunks through the private send buffers."""
        data, total, pos, first = memoryview(message), len(message), 0, True
        with self._send_lock:
            while first or pos < total:
                i = self._next_send
                self._next_send = (i + 1) % SEND_BUFFERS
                if self._send_done[i] is not None:
                    self.wait(self._send_done[i])           # the buffer is ours again
                base, head = i * CHUNK, FRAME.size if first else 0
                if first:
                    FRAME.pack_into(self._outbox.buf, base, total)
                n = min(CHUNK - head, total - pos)
                self._outbox.buf[base + head:base + head + n] = np.frombuffer(data[pos:pos + n], np.uint8)
                self._send_done[i] = self._post(self.ep.post_send, self._outbox.buf[base:base + head + n])
                pos, first = pos + n, False
        self.copies += 1 if copied else 0              # into the private send buffers

    def close(self) -> None:
        super().close()
        self._inbox.close()
        self._outbox.close()
