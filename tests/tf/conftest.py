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
    from tf_plugin.training import models
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
    registered for tf_plugin.graph.ops; returns {rank: result}, raising the first failure."""
    from tf_plugin.graph import ops

    from ..support.ranks import check
    from ..support.ranks import run_ranks as run

    def with_ops(s, rank):
        with ops.use(s):
            return body(s)
    return check(run(ranks, plan, provider, with_ops, join_timeout=timeout))
