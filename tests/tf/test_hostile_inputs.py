"""Broken scripts at the plugin level (hostile_script.py, two processes over tcp):
each case ends in a typed error naming the tensor and the rank, on every rank
involved, within seconds (the session timeout is 3 s here), never a hang or
a wrong result; after a plan mismatch or a NaN the job goes on, after a
divergence it joins again."""
import json

from .processes import run_workers

SCRIPT = __import__("pathlib").Path(__file__).parent / "hostile_script.py"


def test_broken_scripts_get_typed_errors_naming_the_tensor_and_the_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("RDMATENSOR_CHECK_FINITE", "1")
    run_workers(SCRIPT, 2, "tcp", tmp_path, timeout=150)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, rep in enumerate(reports):
        case = rep["different_models"]                 # rank 1's hidden layer is 9 wide, rank 0's 8
        assert case["error"] == "CollectiveMismatch" and case["after_ok"], case
        assert "'sequential/hidden/kernel' differs (shape: [6, 8] vs [6, 9])" in case["message"]
        assert f"on rank {rank}" in case["message"] and case["tensor"] == "sequential/hidden/kernel"

        case = rep["nan"]                              # rank 1's data holds a NaN
        assert case["error"] == "NonFiniteValue" and case["after_ok"], case
        assert case["tensor"].endswith("dense/kernel")
        if rank == 1:
            assert case["peer"] == 1 and "rank 1's value holds NaN or Inf" in case["message"], case
        else:
            assert case["peer"] is None and "from another rank (rank 0's own value is finite)" in case["message"]

        case = rep["nan_in_graph"]                     # an Inf in rank 1's data, inside tf.function:
        assert case["error"] == "UnknownError" and case["after_ok"], case     # TensorFlow's wrapper
        assert "NonFiniteValue: allreduce of " in case["message"] and "dense/kernel" in case["message"]
        assert (f"rank {rank}'s value holds NaN or Inf" if rank == 1 else
                f"from another rank (rank {rank}'s own value is finite)") in case["message"]

        case = rep["shape_change"]                     # 'grad' is 5 long on rank 1 at step 3, else 4
        assert case["error"] == "CollectiveMismatch" and case["after_ok"], case
        assert case["tensor"] == "grad" and case["peer"] == 1 - rank
        assert "'grad' float32 [5]" in case["message"] and "'grad' float32 [4]" in case["message"]
        assert case["seconds"] < 10, case

    case = reports[0]["one_rank_only"]                 # rank 0 alone calls allreduce('lonely')
    assert case["error"] == "RecvTimeout" and case["tensor"] == "lonely" and case["peer"] == 1, case
    assert "allreduce of 'lonely' on rank 0: rank 1 did not take part within the timeout" in case["message"]
    assert case["seconds"] < 10
    assert reports[1]["one_rank_only"]["error"] is None
