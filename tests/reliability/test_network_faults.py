"""Network faults between two SoftRoCE VMs (boots them: marked vm).

netem (1 % loss and 5 ms delay on both ends) slows transfers down but every
byte arrives intact, over tcp and over verbs (RC retransmits); a link taken
down in the middle of a stream makes both sides fail with a typed error
within a bound instead of hanging, and close() still returns."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vm
ROOT = Path(__file__).resolve().parents[2]
TYPED = {"PeerLost", "TransportError", "VerbsError", "RecvTimeout", "SendTimeout"}


def test_netem_and_link_down_between_two_vms(vm_ready):
    res = subprocess.run([sys.executable, "-m", "rdmatensor", "softroce", "vm", "--hosts", "2", "--timeout", "900",
                          "--", sys.executable, "-m", "tests.reliability.netfault_peer", "tcp", "verbs"],
                         capture_output=True, text=True, timeout=1000, cwd=ROOT)
    lines = [(host, json.loads(body)) for host, body in re.findall(r"^\[(host\d)\] (\{.*\})$", res.stdout, re.M)]
    for host, line in lines:
        print(host, line)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    steps = {(d["step"], d["provider"], d["rank"]): d for _, d in lines if "provider" in d}
    for provider in ("tcp", "verbs"):
        for rank in (0, 1):
            netem = steps[("netem", provider, rank)]
            assert netem["bad"] == 0, netem
            down = steps[("linkdown", provider, rank)]
            assert down.get("error") in TYPED, down
            assert down["detected_s"] < 35, down
            assert down["close_s"] < 15, down
        assert steps[("linkdown", provider, 1)]["delivered"] >= 5
        print(f"{provider}: netem 1% loss + 5 ms: {steps[('netem', provider, 0)]['clean_MBps']} -> "
              f"{steps[('netem', provider, 0)]['impaired_MBps']} MB/s "
              f"(x{steps[('netem', provider, 0)]['slowdown']} slower), intact; link down: "
              f"rank 0 {steps[('linkdown', provider, 0)]['error']} after "
              f"{steps[('linkdown', provider, 0)]['detected_s']} s, rank 1 "
              f"{steps[('linkdown', provider, 1)]['error']} after {steps[('linkdown', provider, 1)]['detected_s']} s")
