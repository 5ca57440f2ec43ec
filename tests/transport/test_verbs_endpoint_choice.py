"""The compiled verbs endpoint on a host without RDMA: it is built and imports,
opening it says which device is missing, and RDMATENSOR_VERBS_ENDPOINT picks
the endpoint or says why it cannot."""
import pytest

from rdmatensor.devices import active_port
from rdmatensor.errors import DeviceError, ProviderUnavailable
from rdmatensor.providers.verbs import _native_endpoint as compiled
from rdmatensor.providers.verbs import native_endpoint, rc
from rdmatensor.providers.verbs.choose_endpoint import ENDPOINT_ENV, endpoint_class, endpoint_kind


def test_the_compiled_endpoint_is_built_and_imports():
    assert native_endpoint.BUILD_ERROR is None, f"run make setup: {native_endpoint.BUILD_ERROR}"
    assert issubclass(native_endpoint.NativeEndpoint, compiled.Endpoint)
    assert compiled.status_name(12) == "IBV_WC_RETRY_EXC_ERR"
    assert (compiled.MAX_CHAIN, compiled.RECV_BATCH) == (rc.MAX_CHAIN, rc.RECV_BATCH)


def test_the_compiled_endpoint_pairs_immediates_as_the_layout_says():
    """A credit rides in a write's immediate by contract.pair_imm's rule: the
    compiled endpoint's copy of it agrees on every kind, tag and index edge."""
    import random

    from rdmatensor.providers.contract import IMM_CREDIT, IMM_DATA, IMM_PAIR, MAX_SLOTS, make_imm, pair_imm
    rng = random.Random(3)
    edges = [0, 1, (1 << 15) - 1, 1 << 15, MAX_SLOTS - 1]
    cases = [(make_imm(dk, di, dt), make_imm(ck, ci, ct))
             for dk in (IMM_DATA, IMM_CREDIT, IMM_PAIR, 3) for ck in (IMM_DATA, IMM_CREDIT, IMM_PAIR, 3)
             for di in edges for ci in edges for dt in (0, 1) for ct in (0, 5)]
    cases += [(rng.getrandbits(32), rng.getrandbits(32)) for _ in range(2000)]
    cases += [(make_imm(IMM_DATA, rng.randrange(1 << 16)), make_imm(IMM_CREDIT, rng.randrange(1 << 16)))
              for _ in range(1000)]
    paired = 0
    for data, credit in cases:
        assert compiled.pair_imm(data, credit) == pair_imm(data, credit), (hex(data), hex(credit))
        paired += pair_imm(data, credit) is not None
    assert paired > 100


def test_opening_a_device_that_is_not_there_is_a_device_error():
    with pytest.raises(DeviceError, match="no-such-device|no RDMA device"):
        native_endpoint.NativeEndpoint("no-such-device")
    if active_port() is None:                    # this host has no RDMA at all (this project's CI)
        with pytest.raises(DeviceError, match="no RDMA device with an ACTIVE port"):
            native_endpoint.NativeEndpoint()


def test_the_environment_picks_the_endpoint(monkeypatch):
    monkeypatch.delenv(ENDPOINT_ENV, raising=False)
    assert endpoint_kind() == "native" and endpoint_class() is native_endpoint.NativeEndpoint
    monkeypatch.setenv(ENDPOINT_ENV, "pyverbs")
    assert endpoint_class().__name__ == "RcEndpoint"
    monkeypatch.setenv(ENDPOINT_ENV, "native")
    assert endpoint_class() is native_endpoint.NativeEndpoint
    monkeypatch.setenv(ENDPOINT_ENV, "fast")
    with pytest.raises(ProviderUnavailable, match="RDMATENSOR_VERBS_ENDPOINT='fast'"):
        endpoint_class()


def test_asking_for_the_compiled_endpoint_where_it_is_not_built_says_so(monkeypatch):
    monkeypatch.setattr(native_endpoint, "BUILD_ERROR", "No module named '_native_endpoint'")
    monkeypatch.delenv(ENDPOINT_ENV, raising=False)
    assert endpoint_kind() == "pyverbs"                   # the default falls back
    with pytest.raises(ProviderUnavailable, match="not built.*make setup"):
        endpoint_class("native")


def test_gids_round_trip():
    gid = "0000:0000:0000:0000:0000:ffff:c000:0201"
    assert rc.gid_str(rc.gid_bytes(gid)) == gid
    with pytest.raises(ValueError):
        rc.gid_bytes("fe80::1")
