"""Setup: control calls grow with peers, not tensors; TLS; provider choice."""
import logging
import subprocess

import numpy as np
import pytest

from rdmatensor import Plan, ProviderUnavailable, TensorSpec, TlsConfig
from rdmatensor.errors import PeerLost
from rdmatensor.providers import choose, provider_class

from ..support.ranks import check, run_ranks


@pytest.mark.parametrize("count", [1, 1000])
def test_control_calls_do_not_grow_with_tensors(count):
    plan = Plan([TensorSpec(f"t{i}", (4,), np.float32, 0, 1) for i in range(count)])

    def body(s, r):
        setup_calls = s.stats()["control_calls"]
        for step in range(3):
            for i in range(count):
                if r == 0:
                    s.send(f"t{i}", np.full(4, step, np.float32))
                else:
                    s.recv(f"t{i}").release()
        return setup_calls, s.stats()["control_calls"]

    res = check(run_ranks(2, plan, "tcp", body))
    # rank 0 initiates one Exchange; rank 1 joins rank 0's setup barrier; each first says Hello.
    assert res[0] == (2, 2)
    assert res[1] == (2, 2)


def _make_tls(tmp_path, name):
    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tmp_path)
    if not (tmp_path / "ca.pem").exists():
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
            "-days", "1", "-subj", "/CN=rdmatensor-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
        "-subj", f"/CN={name}")
    (tmp_path / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", f"{name}.pem", "-days", "1", "-extfile", "san.ext")
    return TlsConfig((tmp_path / f"{name}.pem").read_bytes(), (tmp_path / f"{name}.key").read_bytes(),
                     (tmp_path / "ca.pem").read_bytes())


def test_tls_control_plane(tmp_path):
    tls = _make_tls(tmp_path, "node")
    plan = Plan([TensorSpec("a", (16,), np.float32, 0, 1)])

    def body(s, r):
        if r == 0:
            s.send("a", np.arange(16, dtype=np.float32))
            return None
        with s.recv("a") as v:
            return v.tolist()

    assert check(run_ranks(2, plan, "tcp", body, tls=tls))[1] == list(range(16))


def test_tls_refuses_a_plaintext_peer(tmp_path):
    tls = _make_tls(tmp_path, "node")
    plan = Plan([TensorSpec("a", (16,), np.float32, 0, 1)])
    results = {}
    import threading
    from rdmatensor import connect
    from ..support.ranks import TOKEN, free_ports
    peers = {r: f"127.0.0.1:{p}" for r, p in enumerate(free_ports(2))}

    def rank(r, **kw):
        try:
            with connect(r, peers, plan, provider="tcp", token=TOKEN, timeout=4, **kw):
                results[r] = "connected"
        except Exception as exc:  # noqa: BLE001
            results[r] = exc
    threads = [threading.Thread(target=rank, args=(0,)),                 # plaintext client
               threading.Thread(target=rank, args=(1,), kwargs={"tls": tls})]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert isinstance(results[0], PeerLost) and isinstance(results[1], PeerLost), results


def test_explicit_provider_that_cannot_run_says_why():
    ok, why = provider_class("verbs").viable()
    if ok:
        assert choose("verbs", {1: "127.0.0.1"})[1].name == "verbs"
    else:
        with pytest.raises(ProviderUnavailable, match="verbs.*not viable"):
            choose("verbs", {1: "127.0.0.1"})
    with pytest.raises(ProviderUnavailable, match="unknown provider"):
        choose("carrier-pigeon", {1: "127.0.0.1"})


def test_auto_chooses_per_peer_and_logs_each_pair(caplog):
    """shm with a peer on this host; verbs (where an RDMA port is ACTIVE), else
    tcp, with a peer elsewhere (TEST-NET-2: not an address of this host)."""
    caplog.set_level(logging.INFO, logger="rdmatensor")
    got = choose("auto", {1: "127.0.0.1", 2: "198.51.100.7", 3: "localhost"}, rank=0)
    remote = "verbs" if provider_class("verbs").viable()[0] else "tcp"
    assert {p: c.name for p, c in got.items()} == {1: "shm", 2: remote, 3: "shm"}
    assert "provider auto: rank 0 -> rank 1: shm (on this host)" in caplog.text
    assert f"provider auto: rank 0 -> rank 2: {remote} (on 198.51.100.7;" in caplog.text


@pytest.mark.parametrize("rank", [0, 1])      # 0 calls the missing peer's server; 1 waits for its call
def test_setup_gives_up_when_its_abort_hook_raises_not_at_the_timeout(rank):
    """A job that learns elsewhere that a peer is gone (its other sessions'
    heartbeats) must not wait out the setup timeout for it."""
    import time

    from rdmatensor import connect

    from ..support.ranks import TOKEN, free_ports
    plan = Plan([TensorSpec("a", (4,), np.float32, 0, 1)])
    peers = {r: f"127.0.0.1:{p}" for r, p in enumerate(free_ports(2))}     # the other rank never starts
    t0 = time.monotonic()

    def abort():
        if time.monotonic() - t0 > 0.5:
            raise PeerLost("the job lost the other rank", peer=1 - rank)

    with pytest.raises(PeerLost, match="the job lost the other rank"):
        connect(rank, peers, plan, provider="tcp", token=TOKEN, timeout=60.0, abort=abort)
    assert time.monotonic() - t0 < 3.0


PIDNS_RANK = """
import sys, numpy as np
from rdmatensor import Plan, TensorSpec, connect
rank, port0, port1 = int(sys.argv[1]), sys.argv[2], sys.argv[3]
plan = Plan([TensorSpec("t", (4,), np.float32, 0, 1)])
try:
    with connect(rank, {0: "127.0.0.1:" + port0, 1: "127.0.0.1:" + port1}, plan, provider="auto",
                 token="p" * 32, timeout=30) as s:
        print("connected")
except Exception as e:
    print(type(e).__name__ + ": " + str(e))
"""


def test_a_peer_on_this_host_in_another_pid_namespace_is_refused_at_once_saying_what_to_do():
    """Two containers sharing the host's network: auto picks shm, whose segments are
    taken only from the pid the peer announced, which the other namespace numbers
    differently. Both ranks fail at the Exchange, naming the cause and the way out,
    before any segment is opened."""
    import sys
    import time

    from ..support.ranks import free_ports
    ports = [str(p) for p in free_ports(2)]
    t0 = time.monotonic()
    procs = [subprocess.Popen([*(["unshare", "--pid", "--fork"] if r else []), sys.executable, "-c", PIDNS_RANK,
                               str(r), *ports], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert time.monotonic() - t0 < 25, outs                    # not the 30 s setup timeout
    assert outs[0].strip().splitlines()[-1].startswith("BadRequest: rank 1 cannot serve rank 0 over shm: "), outs
    assert outs[1].strip().splitlines()[-1].startswith("TransportError: peer 0 runs on this host but in another "
                                                       "PID namespace"), outs
    assert "RDMATENSOR_PROVIDER=tcp" in outs[0] and "ForeignSegment" not in "".join(outs)


OLDER_RANK = """
import sys
import rdmatensor.session.exchange as x
x.WIRE_VERSION = 0                                    # sends no format, and checks none: a release before it
x.Exchange._check_wire = lambda self, peer, theirs: None
""" + PIDNS_RANK.replace("timeout=30", "timeout=5")   # (it waits for a peer that already refused it)


@pytest.mark.parametrize("older", [0, 1])
def test_a_rank_of_an_older_release_is_refused_before_any_write(older):
    """Ranks that would write immediates the other cannot read (PAIR is data path
    format 2) never start: the Exchange says which rank runs what, on the side
    that asks (rank 0) and on the side that answers (rank 1) alike, even when
    the older rank checks nothing itself."""
    import sys
    import time

    from ..support.ranks import free_ports
    ports = [str(p) for p in free_ports(2)]
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", OLDER_RANK if r == older else PIDNS_RANK, str(r), *ports],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    newer = 1 - older
    out = procs[newer].communicate(timeout=90)[0].strip().splitlines()[-1]
    assert time.monotonic() - t0 < 25, out                     # not the 30 s setup timeout
    assert out == (f"PlanMismatch: rank {older} writes the data path in a release older than format "
                   f"numbers, rank {newer} in format 2: run the same rdmatensor on every rank")
    assert procs[older].communicate(timeout=90)[0].strip().splitlines()[-1] != "connected"


def test_each_rails_parameters_and_keys_cross_the_control_plane():
    """What a verbs channel over several rails sends at setup (providers/verbs/rails.py)
    survives the protobuf messages: each further rail's parameters, and a region's
    key on every rail."""
    from rdmatensor.session.exchange import params_dict, params_msg, region_dict, region_msg
    rail = {"qpn": 7, "psn": 9, "gid": "fe80::1", "mtu": 4096, "lid": 0, "link_layer": "Ethernet"}
    params = {"qpn": 5, "psn": 3, "gid": "fe80::2", "mtu": 4096, "rails": [rail, {**rail, "qpn": 8}]}
    back = params_dict(params_msg("verbs", params))
    assert back["qpn"] == 5 and [r["qpn"] for r in back["rails"]] == [7, 8] and back["rails"][0]["psn"] == 9
    assert "rails" not in params_dict(params_msg("verbs", {"qpn": 5}))
    desc = {"region_id": 2, "size": 4096, "key": 11, "addr": 1 << 20, "rail_keys": [12, 13]}
    assert region_dict(region_msg(desc))["rail_keys"] == [12, 13]
    assert region_dict(region_msg({"region_id": 2, "size": 1, "key": 11}))["rail_keys"] == []
