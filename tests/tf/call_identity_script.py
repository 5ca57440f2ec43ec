"""No value reaches a call it was not written for, and a mismatched call fails on
every rank while the next one works (Horovod API, one process per rank, started
by rdmatensor-run). Writes OUT_DIR/rank{R}.json.

    python call_identity_script.py OUT_DIR CALLS SEED

1. Integer pre/postscale as Horovod computes it: in float64, truncated back.
2. Two allgathers of one name with different dtypes, both already planned,
   called one per rank: every rank raises within seconds, and the next
   agreeing call returns its own values (never the failed call's). Then a planned
   call on rank 0 finds its peers' values already in when it looks up its set.
3. CALLS random collectives (allreduce sum/average, allgather, broadcast from
   any root, over a small pool of names, dtypes and shapes, so most calls hit
   tensor sets already planned). One in eight is changed on one rank (dtype,
   shape, op, root or kind). Every agreeing call must equal the numpy
   reference exactly; every changed call must raise on every rank.
"""
import json
import sys
import time

import numpy as np
import tensorflow as tf

import tf_plugin as hvd
from tf_plugin.core.collectives import Collectives
from tf_plugin.horovod.world import world

out_dir, calls, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
hvd.init()
rank, size = hvd.rank(), hvd.size()
report = {"rank": rank}

# 1. Integer prescale and postscale.
x = tf.constant([1, 2, 3, 50], tf.int32) * (rank + 1)
report["prescale"] = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.19, name="scaled").numpy().tolist()
report["postscale"] = hvd.allreduce(x, op=hvd.Sum, postscale_factor=0.19, name="scaled").numpy().tolist()
report["int_average"] = hvd.allreduce(tf.constant([-3, 3, -5, 7], tf.int64) * (rank + 1), name="avg").numpy().tolist()


# 2. Same name, different dtypes, both sets planned.
def gathered(dtype, r):
    return np.full((17 + 15 * r, 17, 17), r + 1, dtype)


for dtype in (np.float32, np.int32):           # both planned, agreeing
    hvd.allgather(tf.constant(gathered(dtype, rank)), name="leftover")
mine = np.float32 if rank == 0 else np.int32
t0 = time.monotonic()
try:
    hvd.allgather(tf.constant(gathered(mine, rank)), name="leftover")
    report["diverged"] = {"error": None}
except Exception as exc:  # noqa: BLE001 - the point of the case
    report["diverged"] = {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - t0,
                          "is_failed_precondition": isinstance(exc, tf.errors.FailedPreconditionError)}
out = hvd.allgather(tf.constant(gathered(np.int32, rank)), name="leftover").numpy()
report["after"] = bool(np.array_equal(out, np.concatenate([gathered(np.int32, r) for r in range(size)])))
report["after_shape"] = list(out.shape)

# 2b. A planned call on rank 0 whose peers' values are in before it looks up its set:
# the watchdog, judging at that instant, sees no divergence (it once took the lookup
# for a proposal of a new set, and failed a call every rank made alike).
judged = []
if rank == 0:
    engine = world().collectives
    lookup = Collectives.ensure

    def judging(self, requests, number=None):
        if self is engine and not judged:
            deadline = time.monotonic() + 10
            while len(engine.session.arrived()) < size - 1 and time.monotonic() < deadline:
                time.sleep(0.005)
            judged.append(repr(engine._divergence({})))
        return lookup(self, requests, number)
    Collectives.ensure = judging
out = hvd.allgather(tf.constant(gathered(np.int32, rank)), name="leftover").numpy()
if rank == 0:
    Collectives.ensure = lookup
report["judged"] = judged
report["judged_ok"] = bool(np.array_equal(out, np.concatenate([gathered(np.int32, r) for r in range(size)])))

# 3. Random collectives, some changed on one rank.
NAMES, DTYPES, SHAPES = ["a", "b", "c"], [np.float32, np.int32, np.float64], [(4, 3), (6, 3), (5,)]


def value(call: int, r: int, dtype, shape, kind):
    rows = shape[0] + (r if kind == "allgather" and call % 2 else 0)    # allgather: rows may differ by rank
    v = np.random.default_rng([seed, call, r]).integers(-50, 50, (rows, *shape[1:]))
    return v.astype(dtype)


rng = np.random.default_rng(seed)                    # the same choices on every rank
results = {"agreed": 0, "agreed_ok": 0, "changed": 0, "changed_raised": 0, "slowest_raise": 0.0, "wrong": []}
for call in range(calls):
    kind = str(rng.choice(["sum", "average", "allgather", "broadcast"]))
    name, dtype, shape = str(rng.choice(NAMES)), DTYPES[rng.integers(3)], SHAPES[rng.integers(3)]
    root = int(rng.integers(size))
    changed = rng.random() < 0.125
    victim = int(rng.integers(size))
    change = str(rng.choice(["dtype", "shape", "op", "root", "kind"]))
    if changed and change == "root":                 # every rank broadcasts; only the victim's root differs
        kind = "broadcast"
        root = (root + 1) % size if rank == victim else root
    elif changed and rank == victim:
        if change == "dtype":
            dtype = np.float64 if dtype != np.float64 else np.float32
        elif change == "shape":
            shape = (7, 3) if shape != (7, 3) else (4, 3)
        elif change == "op":
            kind = {"sum": "average", "average": "sum", "allgather": "sum", "broadcast": "allgather"}[kind]
        else:
            kind = "allgather" if kind != "allgather" else "sum"
    mine = value(call, rank, dtype, shape, kind)
    t0 = time.monotonic()
    try:
        if kind == "allgather":
            got = hvd.allgather(tf.constant(mine), name=name).numpy()
            want = np.concatenate([value(call, r, dtype, shape, kind) for r in range(size)])
        elif kind == "broadcast":
            got = hvd.broadcast(tf.constant(mine), root, name=name).numpy()
            want = value(call, root, dtype, shape, kind)
        else:
            got = hvd.allreduce(tf.constant(mine), op=hvd.Sum if kind == "sum" else hvd.Average, name=name).numpy()
            total = sum(value(call, r, dtype, shape, kind).astype(np.float64) for r in range(size))
            want = total.astype(dtype)       # exact: small integers
            if kind == "average":            # as Horovod: times 1/size, integers in float64 then truncated
                want = (np.trunc(total * (1.0 / size)) if np.dtype(dtype).kind == "i" else
                        want * np.dtype(dtype).type(1.0 / size)).astype(dtype)
        error = None
    except Exception as exc:  # noqa: BLE001 - the point of the case
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
    took = time.monotonic() - t0
    if changed:
        results["changed"] += 1
        results["changed_raised"] += error is not None
        results["slowest_raise"] = max(results["slowest_raise"], took if error else 0.0)
        if error and took > 5:
            results.setdefault("slow", []).append(f"call {call}: {change} on rank {victim} ({kind} {name}) "
                                                  f"raised after {took:.1f} s: {error[:200]}")
        if error is None:
            results["wrong"].append(f"call {call}: changed ({change} on rank {victim}) but no error")
    else:
        results["agreed"] += 1
        if error is not None:
            results["wrong"].append(f"call {call}: {kind} {name} {np.dtype(dtype)} {shape} raised {error}")
        elif got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(got, want):
            results["wrong"].append(f"call {call}: {kind} {name} wrong value {got.dtype} {got.shape}")
        else:
            results["agreed_ok"] += 1
report["random"] = results
report["stats"] = {k: v for k, v in hvd.stats().items() if isinstance(v, (int, float, str)) or v is None}
with open(f"{out_dir}/rank{rank}.json", "w") as f:
    json.dump(report, f)
hvd.shutdown()
