"""TensorFlow plugin tests. TensorFlow is imported once per pytest process (about
3 s on the host, about 45 s inside the SoftRoCE VM), so ranks run as threads
of this process except where a test is about processes (the launcher)."""
import functools
import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

STEPS = 20
RTOL = {"mlp": 1e-5, "cnn": 1e-3, "embed": 1e-5}


@functools.lru_cache(maxsize=None)
def reference(model: str, steps: int = STEPS, seed: int = 0) -> tuple:
    """Single-process losses on the global batch, one per step."""
    from tf_plugin import models
    return tuple(models.train_local(model, steps, seed=seed))


@pytest.fixture
def close_to_reference():
    import numpy as np

    def check(model, losses, steps=STEPS):
        want = np.array(reference(model, steps))
        np.testing.assert_allclose(np.array(losses), want, rtol=RTOL[model], atol=1e-6)
        assert want[-1] < want[0], "the reference did not learn anything"
    return check


def run_ranks(plan, provider, body, ranks=2, timeout=120.0):
    """body(session) on every rank of `plan`, each in a thread with its own session,
    registered for tf_plugin.ops; returns {rank: result}, raising the first failure."""
    import threading
    import traceback

    from rdmatensor import connect
    from tf_plugin import ops
    from tf_plugin.cluster import Cluster
    peers = Cluster.local(ranks).peers()
    results = {}

    def one(rank):
        try:
            with connect(rank, peers, plan, provider=provider, token="tf-tests") as s, ops.use(s):
                results[rank] = body(s)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            results[rank] = AssertionError(f"rank {rank}:\n{traceback.format_exc()}")

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), f"a rank did not finish within {timeout} s"
    for r in sorted(results):
        if isinstance(results[r], BaseException):
            raise results[r]
    return results
