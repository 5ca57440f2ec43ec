"""A slot's byte layout, encoded and parsed, without sockets."""
import numpy as np
import pytest

from rdmatensor.errors import IntegrityError
from rdmatensor.plan import Plan, TensorSpec
from rdmatensor.session import wire

DYN = TensorSpec("seq", (None, 3), np.int16, 0, 1)
STATIC = TensorSpec("w", (5,), np.float64, 0, 1)


@pytest.mark.parametrize("checksum", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 7, 100])
def test_dynamic_values_round_trip(checksum, rows):
    plan = Plan([DYN], checksum=checksum)
    value = np.arange(rows * 3, dtype=np.int16).reshape(rows, 3)
    staging = np.zeros(4096, np.uint8)
    nbytes, copied = wire.encode(DYN, plan, value, staging)
    assert nbytes == wire.frame_bytes(DYN, plan, value.nbytes)
    assert copied == (rows > 0)
    header = staging[:DYN.header_bytes()].view(np.int64)
    assert header[:3].tolist() == [2, rows, 3]
    got = wire.decode(DYN, plan, staging[:nbytes])
    assert got.shape == (rows, 3) and np.array_equal(got, value)
    assert np.shares_memory(got, staging) or rows == 0


def test_a_static_value_in_a_checksum_plan_is_payload_then_crc():
    plan = Plan([STATIC], checksum=True)
    assert not wire.is_raw(STATIC, plan) and wire.is_raw(STATIC, Plan([STATIC]))
    staging = np.zeros(wire.frame_bytes(STATIC, plan, 40), np.uint8)
    value = np.linspace(0, 1, 5)
    nbytes, _ = wire.encode(STATIC, plan, value, staging)
    assert nbytes == 48
    assert np.array_equal(wire.decode(STATIC, plan, staging), value)


@pytest.mark.parametrize("header, why", [
    ([3, 2, 3], "malformed"),           # wrong rank
    ([2, -1, 3], "malformed"),          # negative dimension
    ([2, 2, 4], "malformed"),           # a static dimension that differs from the spec
    ([2, 1000, 3], "claims"),           # more bytes than the slot holds
    ([2, 2 ** 40, 3], "claims"),
])
def test_a_bad_header_is_an_integrity_error_naming_the_tensor(header, why):
    plan = Plan([DYN])
    mem = np.zeros(256, np.uint8)
    mem[:24].view(np.int64)[:] = header
    with pytest.raises(IntegrityError, match=why) as info:
        wire.decode(DYN, plan, mem)
    assert info.value.tensor == "seq" and info.value.peer == 0


def test_a_header_whose_trailer_falls_outside_the_slot_is_refused():
    plan = Plan([DYN], checksum=True)
    mem = np.zeros(DYN.header_bytes() + 12, np.uint8)     # room for 2 rows, none for the trailer
    mem[:24].view(np.int64)[:] = [2, 2, 3]
    with pytest.raises(IntegrityError, match="claims"):
        wire.decode(DYN, plan, mem)


def test_a_flipped_bit_fails_the_checksum():
    plan = Plan([DYN], checksum=True)
    staging = np.zeros(4096, np.uint8)
    nbytes, _ = wire.encode(DYN, plan, np.ones((4, 3), np.int16), staging)
    staging[DYN.header_bytes() + 5] ^= 1
    with pytest.raises(IntegrityError, match="checksum"):
        wire.decode(DYN, plan, staging[:nbytes])
