"""Two rails between two hosts, for real: `make test-rails` (not in `make test`:
it boots two VMs for a few minutes and proves bytes and bits, not speed).

Two SoftRoCE VMs with two NICs each (`softroce vm --hosts 2 --rails 2`):
eth0 and eth1 on subnets of their own, rxe0 and rxe1 on them. host0 starts
every job over ssh; eth0 also carries the control traffic. Each job runs
twice, with RDMATENSOR_IB_RAILS=1 and 2, and every host's bytes sent on each
NIC are read from /sys/class/net around it.
"""
from __future__ import annotations

import json
import re
import shlex
import sys

from tests.vm.test_softroce_vm import ROOT, softroce_vm  # noqa: F401 - the VM fixture's helpers

PY = sys.executable
HOSTS = ("192.0.2.1", "192.0.2.2")
COUNTERS = "cat /sys/class/net/eth0/statistics/tx_bytes /sys/class/net/eth1/statistics/tx_bytes"


def _snapshot(tag: str) -> str:
    """One line per host: TAG host eth0_tx eth1_tx."""
    return "".join(f"echo {tag} {h} $(ssh {h} {shlex.quote(COUNTERS)} | tr '\\n' ' '); " for h in HOSTS)


def _job(rails: int, argv: list[str]) -> str:
    run = [PY, "-m", "rdmatensor.runner.cli", "-np", "2", "-H", f"{HOSTS[0]}:1,{HOSTS[1]}:1",
           "-x", "RDMATENSOR_IB_RAILS", "-x", "RDMATENSOR_PROVIDER", "-x", "TF_CPP_MIN_LOG_LEVEL", *argv]
    return (_snapshot(f"before{rails}") + f"RDMATENSOR_IB_RAILS={rails} RDMATENSOR_PROVIDER=verbs "
            "TF_CPP_MIN_LOG_LEVEL=2 " + shlex.join(run) + f" | sed 's/^/rails{rails} /'; "
            + _snapshot(f"after{rails}"))


def _sent(out: str, rails: int) -> dict[str, list[int]]:
    """host -> bytes sent on [eth0, eth1] during the job with `rails` rails."""
    read = {}
    for when in ("before", "after"):
        for host, a, b in re.findall(rf"^\[host0\] {when}{rails} (\S+) (\d+) (\d+)", out, re.M):
            read.setdefault(host, {})[when] = (int(a), int(b))
    return {h: [v["after"][i] - v["before"][i] for i in range(2)] for h, v in read.items()}


def _lines(out: str, rails: int, key: str) -> list[dict]:
    return [json.loads(line) for line in re.findall(rf"^\[host0\] rails{rails} (?:\[\d\] )?(\{{.*\}})$", out, re.M)
            if key in line]


def test_two_rails_carry_every_tensor_and_train_bit_identical_to_one_rail():
    """all_pairs.py (a 256 KiB tensor each way, striped over both rails) arrives
    intact; MobileNetV2 trains over verbs with 1 and with 2 rails to the same
    weights and loss, bit for bit, with both NICs of both hosts carrying the gradients
    when there are two rails, and eth1 idle with one."""
    train = [PY, "examples/horovod_tape.py", "--model", "mobilenetv2", "--steps", "6", "--batch", "16"]
    script = "".join(_job(r, argv) for r in (1, 2) for argv in ([PY, "examples/all_pairs.py"], train))
    res = softroce_vm("--hosts", "2", "--rails", "2", "--ssh", "--timeout", "1500", "--", "sh", "-c", script,
                      timeout=1600)
    out, err = res.stdout, res.stderr
    assert res.returncode == 0, out[-3000:] + err[-3000:]
    trained = {}
    for rails in (1, 2):
        pairs = _lines(out, rails, '"ok"')
        assert len(pairs) == 2 and all(p["ok"] for p in pairs), out[-3000:]
        assert all(set(p["providers"].values()) == {"verbs"} for p in pairs), pairs
        # rank 0's weights (batch norm's moving statistics are each rank's own)
        [trained[rails]] = _lines(out, rails, "weights_sha256")
    assert trained[1]["weights_sha256"] == trained[2]["weights_sha256"], trained
    assert trained[1]["final_loss"] == trained[2]["final_loss"], trained
    one, two = _sent(out, 1), _sent(out, 2)
    gradients = 6 * trained[2]["bytes_sent_per_step"]         # per rank, over the timed steps and more
    for host in HOSTS:
        assert one[host][1] < 1 << 20, one                    # one rail: eth1 carries nothing of it
        # two rails: each NIC carries a large share of the gradients
        assert min(two[host]) > gradients / 4, (two, gradients)
    print(f"two rails, bytes sent on eth0/eth1: {two}; one rail: {one}")
