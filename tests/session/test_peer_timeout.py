"""RDMATENSOR_PEER_TIMEOUT: how long a silent peer is waited for before it is
lost, and how long each ping waits, with the default unchanged."""
import pytest

from rdmatensor import Plan, UsageError, connect
from rdmatensor.session.liveness import PEER_TIMEOUT, misses_to_lose, peer_timeout_from_env, ping_timeout


def test_unset_or_empty_is_ten_seconds_and_pings_wait_two(monkeypatch):
    monkeypatch.delenv("RDMATENSOR_PEER_TIMEOUT", raising=False)
    assert peer_timeout_from_env() == PEER_TIMEOUT == 10.0
    monkeypatch.setenv("RDMATENSOR_PEER_TIMEOUT", "")
    assert peer_timeout_from_env() == 10.0
    assert ping_timeout(1.0, 10.0) == 2.0          # as before the setting existed
    assert ping_timeout(0.05, 0.5) == 0.5          # never longer than the peer timeout
    assert misses_to_lose(10.0) == misses_to_lose(0.5) == 2


def test_a_longer_peer_timeout_makes_each_ping_wait_a_fifth_of_it(monkeypatch):
    monkeypatch.setenv("RDMATENSOR_PEER_TIMEOUT", "120")
    assert peer_timeout_from_env() == 120.0
    assert ping_timeout(1.0, 120.0) == 24.0
    assert misses_to_lose(120.0) == 24              # quick refusals from a starved host do not add up to 2
    with connect(0, {0: "127.0.0.1:0"}, Plan([]), provider="tcp", token="tok") as session:
        assert session.peer_timeout == 120.0              # what its heartbeats use


@pytest.mark.parametrize("value", ["abc", "0", "-5", "0.5", "nan"])
def test_a_bad_value_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("RDMATENSOR_PEER_TIMEOUT", value)
    with pytest.raises(UsageError, match=f"RDMATENSOR_PEER_TIMEOUT='{value}': give seconds, 1 or more"):
        peer_timeout_from_env()
