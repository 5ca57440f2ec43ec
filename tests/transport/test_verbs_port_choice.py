"""Which device and port a rank opens (choose_port): RDMATENSOR_IB_HCA as a list
or an exclusion, the NIC on the rank's NUMA node first, ranks of one host spread
round-robin by local rank; and what is said when nothing is left."""
import pytest

from rdmatensor.errors import DeviceError
from rdmatensor.providers.verbs.choose_port import Candidate, allowed, local_rank, parse_hca, rails, select

TWO_SOCKETS = [Candidate("mlx5_0", 1, 0), Candidate("mlx5_1", 1, 0), Candidate("mlx5_2", 1, 1),
               Candidate("mlx5_3", 1, 1)]


def test_ranks_spread_over_the_nics_of_their_own_numa_node():
    assert [select(TWO_SOCKETS, "", r, {0}).device for r in range(4)] == ["mlx5_0", "mlx5_1", "mlx5_0", "mlx5_1"]
    assert [select(TWO_SOCKETS, "", r, {1}).device for r in range(2)] == ["mlx5_2", "mlx5_3"]
    assert [select(TWO_SOCKETS, "", r, set()).device for r in range(4)] == [c.device for c in TWO_SOCKETS]


def test_where_the_host_says_nothing_every_nic_is_taken_round_robin():
    unknown = [Candidate("rxe0", 1, -1), Candidate("rxe1", 1, -1)]
    assert [select(unknown, "", r, {0}).device for r in range(3)] == ["rxe0", "rxe1", "rxe0"]


def test_the_hca_list_and_its_exclusion():
    assert select(TWO_SOCKETS, "mlx5_2,mlx5_3", 0, {0}).device == "mlx5_2"     # listed, though on the other node
    assert [select(TWO_SOCKETS, "^mlx5_0", r, {0}).device for r in range(2)] == ["mlx5_1", "mlx5_1"]
    two_ports = [Candidate("mlx5_0", 1, 0), Candidate("mlx5_0", 2, 0)]
    assert select(two_ports, "mlx5_0:2", 0).port == 2
    assert parse_hca("^a,b:2") == (True, [("a", None), ("b", 2)])
    with pytest.raises(DeviceError, match="RDMATENSOR_IB_HCA='mlx5_9'.*ACTIVE ports here: mlx5_0:1"):
        select(TWO_SOCKETS, "mlx5_9", 0)
    with pytest.raises(DeviceError, match="'a:x' is not device or device:port"):
        parse_hca("a:x")


def test_the_local_rank_comes_from_whichever_launcher_set_it():
    assert local_rank({"RDMATENSOR_LOCAL_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}) == 3
    assert local_rank({"OMPI_COMM_WORLD_LOCAL_RANK": "1"}) == 1
    assert local_rank({}) == 0


def test_rails_are_the_ports_left_in_the_order_listed_and_a_port_listed_twice_is_two_rails():
    assert [c.device for c in allowed(TWO_SOCKETS, "mlx5_3,mlx5_1")] == ["mlx5_3", "mlx5_1"]
    assert [c.device for c in allowed(TWO_SOCKETS, "^mlx5_0")] == ["mlx5_1", "mlx5_2", "mlx5_3"]
    assert [c.device for c in allowed(TWO_SOCKETS, "mlx5_2,mlx5_2")] == ["mlx5_2", "mlx5_2"]
    assert select(TWO_SOCKETS, "mlx5_2,mlx5_2", 1, set()).device == "mlx5_2"   # one rail: listed twice is once
    assert rails({}) == 1 and rails({"RDMATENSOR_IB_RAILS": "2"}) == 2
    for bad in ("0", "two", "9"):
        with pytest.raises(DeviceError, match=f"RDMATENSOR_IB_RAILS='{bad}': expected a number of rails"):
            rails({"RDMATENSOR_IB_RAILS": bad})
