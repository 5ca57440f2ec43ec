"""Streaming copies and sums (rdmatensor/_streaming.c): the same bits as a
memcpy and as numpy's add then multiply, at any alignment and length, and
bad buffers refused with a ValueError before anything is written."""
import platform

import numpy as np
import pytest

from rdmatensor import streaming


def test_the_extension_is_built_where_it_can_be():
    if platform.machine() == "x86_64":         # `make setup` builds it: a fallback here would hide a broken build
        assert streaming.BUILD_ERROR is None and streaming.enabled


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 3, 17, 65537, (1 << 20) + 5])
@pytest.mark.parametrize("skew", [0, 1, 3])
def test_add_gives_numpys_bits(dtype, n, skew):
    rng = np.random.default_rng(n + skew)
    a, b = (np.concatenate([np.zeros(skew, dtype), rng.standard_normal(n).astype(dtype)])[skew:] for _ in "ab")
    b[:3] = [np.inf, np.nan, -0.0][:min(3, n)]
    for scale in (None, dtype(1.0 / 3), dtype(0.5)):
        out = np.full(n + skew, 7, dtype)[skew:]
        streaming.add(out, a, b, scale, stream=True)
        want = a + b if scale is None else (a + b) * scale
        assert out.tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_add_into_an_output_not_aligned_to_its_elements(dtype):
    """No line starts on such an output: nothing streams, and the bits are still numpy's."""
    n, size = 70001, np.dtype(dtype).itemsize
    a, b = (np.random.default_rng(k).standard_normal(n).astype(dtype) for k in (1, 2))
    raw = np.zeros(n * size + 1, np.uint8)
    out = raw[1:].view(dtype)
    streaming.add(out, a, b, dtype(0.5), stream=True)
    assert out.tobytes() == ((a + b) * dtype(0.5)).tobytes() and raw[0] == 0


def test_pieces_written_side_by_side_share_lines_and_keep_every_byte():
    """A fused bucket goes out one gradient at a time into one destination: the
    calls' ends share lines (streamed only where a call covers a whole line)."""
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 300, 200)
    lengths[::7] = 70000                              # some above the GIL and line thresholds
    a, b = (rng.standard_normal(lengths.sum()).astype(np.float32) for _ in "ab")
    out, copied, at = np.zeros_like(a), np.zeros_like(a), 0
    for n in lengths:
        part = slice(at, at + n)
        streaming.add(out[part], a[part], b[part], np.float32(0.5), stream=True)
        streaming.copy(copied[part], a[part], stream=True)
        at += n
    assert out.tobytes() == ((a + b) * np.float32(0.5)).tobytes() and copied.tobytes() == a.tobytes()


@pytest.mark.parametrize("n", [0, 1, 15, 64, 1000, (1 << 20) + 3])
def test_copy_writes_exactly_the_destination(n):
    src = np.random.default_rng(n).integers(0, 256, n + 1, dtype=np.uint8)[1:]
    dst = np.zeros(n + 2, np.uint8)
    streaming.copy(dst[1:-1], src, stream=True)
    assert dst[1:-1].tobytes() == src.tobytes() and dst[0] == 0 and dst[-1] == 0


def test_bad_buffers_are_refused_and_nothing_is_written():
    if streaming.BUILD_ERROR is not None:
        pytest.skip(f"not built here: {streaming.BUILD_ERROR}")
    from rdmatensor import _streaming
    dst = np.zeros(8, np.uint8)
    with pytest.raises(ValueError, match="copy of 9 bytes into 8"):
        _streaming.copy(dst, np.ones(9, np.uint8))
    read_only = np.zeros(8, np.uint8)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="dst must be a contiguous, writable buffer"):
        _streaming.copy(read_only, np.ones(8, np.uint8))
    with pytest.raises(ValueError, match="dst must be a contiguous"):
        _streaming.copy(np.zeros(16, np.uint8)[::2], np.ones(8, np.uint8))
    out = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="add takes float32 or float64 elements, not 2-byte"):
        _streaming.add(out, out, out, 2, 1.0)
    with pytest.raises(ValueError, match="add of 16 and 12 bytes into 16"):
        _streaming.add(out, np.ones(4, np.float32), np.ones(3, np.float32), 4, 1.0)
    assert not dst.any() and not out.any()
