"""What a slot holds on the wire, written by encode() and parsed by decode().

    [ header ][ payload ][ pad to 8 ][ trailer ]
      dynamic   the tensor             checksum plans only: CRC32 of the payload, uint64
      tensors:  bytes
      int64 rank, then each dimension (room for the spec's rank, cache-line aligned)

A static tensor in a plan without checksums is the payload alone, written
straight from wherever it is (no staging copy). Anything else goes as one
write from staging. The receiver checks the header against the spec and the
checksum against the payload: a peer's bytes are never trusted.
"""
from __future__ import annotations

import zlib

import numpy as np

from ..errors import IntegrityError
from ..plan import Plan, TensorSpec


def is_raw(spec: TensorSpec, plan: Plan) -> bool:
    """True when the slot holds the payload alone (no header, no trailer)."""
    return spec.is_static and not plan.checksum


def frame_bytes(spec: TensorSpec, plan: Plan, payload_bytes: int) -> int:
    """Bytes a value of `payload_bytes` occupies in its slot, header and trailer included."""
    return plan.trailer_offset(spec.header_bytes() + payload_bytes) + plan.trailer_bytes


def encode(spec: TensorSpec, plan: Plan, array: np.ndarray, staging: np.ndarray) -> tuple[int, bool]:
    """Lay `array` out in `staging` as its slot will hold it. Returns the bytes
    to write and whether the payload was copied (False when the user filled
    staging in place)."""
    header = spec.header_bytes()
    end = header + array.nbytes
    if header:
        hdr = staging[:header].view(np.int64)
        hdr[0] = array.ndim
        hdr[1:1 + array.ndim] = array.shape
    copied = False
    if array.nbytes and array.ctypes.data != staging[header:].ctypes.data:
        np.copyto(staging[header:end].view(array.dtype).reshape(array.shape), array)
        copied = True
    need = frame_bytes(spec, plan, array.nbytes)
    if plan.checksum:
        trailer = plan.trailer_offset(end)
        staging[trailer:need].view(np.uint64)[0] = zlib.crc32(staging[header:end])
    return need, copied


def decode(spec: TensorSpec, plan: Plan, mem: np.ndarray) -> np.ndarray:
    """The tensor in a slot's memory, as a view of it; IntegrityError if the
    header does not fit the spec or the slot, or the checksum does not match."""
    if spec.is_static:
        header, shape, nbytes = 0, spec.shape, spec.nbytes
    else:
        header = spec.header_bytes()
        hdr = mem[:header].view(np.int64)
        shape = tuple(int(d) for d in hdr[1:1 + len(spec.shape)])
        if (int(hdr[0]) != len(spec.shape) or any(d < 0 for d in shape)
                or any(w is not None and w != d for w, d in zip(spec.shape, shape, strict=True))):
            raise IntegrityError(f"{spec.name!r}: malformed shape header {hdr[:1 + len(spec.shape)].tolist()}",
                                 peer=spec.src, tensor=spec.name)
        nbytes = int(np.prod(shape, dtype=np.int64)) * spec.dtype.itemsize if shape else spec.dtype.itemsize
        if nbytes < 0 or frame_bytes(spec, plan, nbytes) > len(mem):
            raise IntegrityError(f"{spec.name!r}: header claims {nbytes} bytes, the slot holds "
                                 f"{len(mem) - header}", peer=spec.src, tensor=spec.name)
    payload = mem[header:header + nbytes]
    if plan.checksum:
        trailer = plan.trailer_offset(header + nbytes)
        want = int(mem[trailer:trailer + 8].view(np.uint64)[0])
        got = zlib.crc32(payload)
        if want != got:
            raise IntegrityError(f"{spec.name!r}: checksum mismatch (crc32 {got:#010x}, "
                                 f"sender said {want:#010x})", peer=spec.src, tensor=spec.name)
    return payload.view(spec.dtype).reshape(shape)
