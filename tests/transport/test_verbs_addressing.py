"""The route both verbs endpoints connect by (addressing.route), for each link
layer, and the fabric settings from the environment. SoftRoCE is RoCE: the
InfiniBand routes are checked here, by the rules, and cannot run on it."""
import pytest

from rdmatensor.errors import TransportError
from rdmatensor.providers.verbs.addressing import ETHERNET, INFINIBAND, Fabric, route
from rdmatensor.providers.verbs.rc import RcParams

ROCE_GID = "0000:0000:0000:0000:0000:ffff:c000:0202"
IB_GID = "fe80:0000:0000:0000:0002:c903:0001:0002"
IB_LOCAL = "fe80:0000:0000:0000:0002:c903:0001:0001"


def peer(gid=ROCE_GID, mtu=4096, lid=0, link=ETHERNET, fabric=None):
    return RcParams(77, 5, gid, mtu, lid, link, Fabric().agreed() if fabric is None else fabric)


def test_roce_is_a_global_route_to_the_peers_gid_with_the_fabric_settings():
    f = Fabric(traffic_class=106, service_level=3, hop_limit=8, timeout=16, retry_count=5)
    r = route(ETHERNET, "0000:0000:0000:0000:0000:ffff:c000:0201", 1024, 1, peer(fabric=f.agreed()), f)
    assert (r.is_global, r.dlid, r.dgid, r.sgid_index, r.path_mtu) == (True, 0, ROCE_GID, 1, 1024)
    assert (r.traffic_class, r.service_level, r.hop_limit, r.timeout, r.retry_count) == (106, 3, 8, 16, 5)


def test_infiniband_in_one_subnet_is_addressed_by_lid_without_a_grh_unless_forced():
    r = route(INFINIBAND, IB_LOCAL, 4096, 0, peer(IB_GID, 2048, lid=0x12, link=INFINIBAND), Fabric())
    assert (r.is_global, r.dlid, r.dgid, r.path_mtu) == (False, 0x12, "", 2048)
    forced = Fabric(force_grh=True)
    r = route(INFINIBAND, IB_LOCAL, 4096, 0, peer(IB_GID, lid=0x12, link=INFINIBAND, fabric=forced.agreed()), forced)
    assert (r.is_global, r.dlid, r.dgid) == (True, 0x12, IB_GID)


def test_what_cannot_be_connected_is_refused_saying_why():
    other_subnet = "fe80:0000:0000:0001:0002:c903:0001:0002"
    with pytest.raises(TransportError, match="another InfiniBand subnet .*path record"):
        route(INFINIBAND, IB_LOCAL, 4096, 0, peer(other_subnet, lid=0x12, link=INFINIBAND), Fabric())
    with pytest.raises(TransportError, match="no unicast LID"):
        route(INFINIBAND, IB_LOCAL, 4096, 0, peer(IB_GID, lid=0, link=INFINIBAND), Fabric())
    with pytest.raises(TransportError, match="the peer's port is InfiniBand, this one Ethernet"):
        route(ETHERNET, ROCE_GID, 4096, 0, peer(IB_GID, lid=3, link=INFINIBAND), Fabric())
    with pytest.raises(TransportError, match="fabric settings differ: the peer has tc=96"):
        route(ETHERNET, ROCE_GID, 4096, 0, peer(fabric=Fabric(traffic_class=96).agreed()), Fabric())


def test_the_path_mtu_is_the_smallest_of_both_ports_and_the_cap():
    assert route(ETHERNET, ROCE_GID, 4096, 0, peer(mtu=2048), Fabric()).path_mtu == 2048
    capped = Fabric(mtu=1024)
    assert route(ETHERNET, ROCE_GID, 4096, 0, peer(fabric=capped.agreed()), capped).path_mtu == 1024


def test_fabric_settings_from_the_environment():
    env = {"RDMATENSOR_IB_TC": "106", "RDMATENSOR_IB_SL": "3", "RDMATENSOR_IB_HOP_LIMIT": "2",
           "RDMATENSOR_IB_PKEY_INDEX": "1", "RDMATENSOR_IB_TIMEOUT": "18", "RDMATENSOR_IB_RETRY_CNT": "6",
           "RDMATENSOR_IB_MTU": "2048", "RDMATENSOR_IB_FORCE_GRH": "1"}
    assert Fabric.from_env(env) == Fabric(106, 3, 2, 1, 18, 6, 2048, True)
    assert Fabric.from_env({}) == Fabric()
    for var, bad in (("RDMATENSOR_IB_SL", "16"), ("RDMATENSOR_IB_TC", "x"), ("RDMATENSOR_IB_TIMEOUT", "32"),
                     ("RDMATENSOR_IB_RETRY_CNT", "8"), ("RDMATENSOR_IB_MTU", "1500"),
                     ("RDMATENSOR_IB_FORCE_GRH", "yes")):
        with pytest.raises(TransportError, match=var):
            Fabric.from_env({var: bad})


def test_an_older_peer_without_the_new_fields_is_roce_as_before():
    old = RcParams(77, 5, ROCE_GID, 1024)
    assert old.link_layer == ETHERNET and old.fabric == ""
    assert route(ETHERNET, ROCE_GID, 4096, 0, old, Fabric()).dgid == ROCE_GID
