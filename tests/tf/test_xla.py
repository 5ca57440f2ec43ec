"""The Horovod API under XLA (tf.function(jit_compile=True), and Keras'
model.compile(jit_compile=True) with DistributedOptimizer) on 2 ranks of one host:
the all-reduce is one typed-FFI custom call per bucket, no PyFunc; every op and
dtype against numpy; training with each rank on its own data ends bit-identical
across ranks, moved from the start, and within 1e-6 of the same steps without XLA
and of one process on the global batch; what stays in Python (allgather, Adasum,
broadcast) raises tf_plugin.errors.InvalidArgument at trace time, naming the way
out. Real processes (rdmatensor-run), the real op library, no mocks."""
import json
from pathlib import Path

import numpy as np
import pytest

from .processes import run_workers

SCRIPT = Path(__file__).parent / "xla_script.py"
CASES = [("sum", "float32"), ("average", "float32"), ("max", "float64"), ("min", "int32"), ("product", "int64"),
         ("sum", "float16")]
FOLD = {"sum": np.add, "average": np.add, "max": np.maximum, "min": np.minimum, "product": np.multiply}


def rank_input(dtype, seed, rank):
    """xla_script.py's input of `rank`."""
    rng = np.random.default_rng([seed, rank])
    if np.dtype(dtype).kind == "f":
        return (rng.standard_normal((3, 5)) * 3).astype(dtype)
    return rng.integers(-9, 10, (3, 5)).astype(dtype)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    where = tmp_path_factory.mktemp("xla")
    run_workers(SCRIPT, 2, "shm", where, timeout=300)
    return [(json.loads((where / f"rank{r}.json").read_text()), dict(np.load(where / f"rank{r}.npz")))
            for r in range(2)]


def test_every_op_and_dtype_is_one_custom_call_with_numpys_values(ranks):
    for report, results in ranks:
        for seed, (op, dtype) in enumerate(CASES):
            inputs = [rank_input(dtype, seed, r) for r in range(2)]
            want = FOLD[op](inputs[0], inputs[1])
            if op == "average":
                want = want * np.asarray(0.5, dtype)              # a power of two: exact
            got = results[f"allreduce_{op}_{dtype}"]
            assert got.dtype == want.dtype and got.shape == want.shape, (op, dtype)
            assert got.tobytes() == want.tobytes(), (op, dtype, got, want)
            assert report[f"hlo_{op}_{dtype}"] == [True, False], (op, dtype)   # the custom call, no PyFunc
        x = [rank_input("float32", 20, r) for r in range(2)]
        np.testing.assert_allclose(results["allreduce_scaled"], (x[0] * 0.5 + x[1] * 0.5) * 3.0, rtol=1e-6)
        assert np.array_equal(results["grouped_0"], x[0] + x[1])
        assert np.array_equal(results["grouped_1"], 2 * x[0] + 2 * x[1])
        assert report["tape_hlo"] == [True, False]


def test_training_under_xla_matches_without_it_and_one_process(ranks):
    (_, first), (_, second) = ranks
    weights = sorted(k for k in first if k.startswith("xla_weight"))
    assert len(weights) == 6
    for kind in ("xla_weight", "plain_weight", "fit_weight"):
        for j in range(6):
            assert first[f"{kind}{j}"].tobytes() == second[f"{kind}{j}"].tobytes(), (kind, j)  # every rank alike
    for j in range(6):
        assert np.abs(first[f"xla_weight{j}"] - first[f"initial_weight{j}"]).max() > 1e-3      # it trained
        for other in ("plain_weight", "one_weight"):
            np.testing.assert_allclose(first[f"xla_weight{j}"], first[f"{other}{j}"], atol=1e-6, rtol=0)
        # Keras fit (model.compile(jit_compile=True), DistributedOptimizer): the same 4 steps
        np.testing.assert_allclose(first[f"fit_weight{j}"], first[f"one_weight{j}"], atol=1e-6, rtol=0)


def test_what_stays_in_python_is_refused_at_trace_time(ranks):
    for report, _ in ranks:
        for name in ("allgather", "adasum", "broadcast"):
            said = report[f"refused_{name}"]
            assert said.startswith("tf_plugin.errors.InvalidArgument:"), said[:300]
            assert "runs in Python, which XLA cannot compile: compile this function with jit_compile=False" in said


def test_one_rank_under_xla_scales_in_the_graph(tmp_path):
    run_workers(SCRIPT, 1, "shm", tmp_path, timeout=200)
    results = dict(np.load(tmp_path / "rank0.npz"))
    assert results["alone"].tolist() == [0.0, 0.5, 1.0, 1.5] and results["empty"].shape == (0,)
    assert json.loads((tmp_path / "rank0.json").read_text()) == {"hlo": False}
