"""Horovod's TensorFlow API with Horovod's semantics (horovod_parity_script.py, one
process per rank): reductions (Adasum against Horovod's own reference), alltoall,
reducescatter, grouped collectives, the gradient Horovod defines for each
collective, the error types it raises, the order of a tf.function's collectives,
SyncBatchNormalization, partial tapes and optimizers, the Keras callbacks'
arguments, fit with a lazily built model, the elastic states' sync, restore and
commit, cross rank and size, a time line started and stopped."""
import json
from pathlib import Path

import pytest

from .processes import run_workers

SCRIPT = Path(__file__).parent / "horovod_parity_script.py"
CASES = ["min", "max", "product", "grouped_min", "adasum", "adasum_refusals", "sparse_min_refused", "alltoall_splits",
         "alltoall_equal", "alltoall_bad_splits", "reducescatter_uneven", "grouped_allgather", "grad_allreduce_sum",
         "grad_allgather", "grad_broadcast", "grad_reducescatter_sum", "grad_alltoall", "ops", "join", "built",
         "executing_eagerly", "global_variables_eager", "process_set", "cross", "broadcast_object_fn", "timeline",
         "broadcast_inplace", "mismatch_types",
         "graph_order", "sync_batch_norm", "partial_tape", "lazy_fit", "broadcast_local_variables",
         "partial_optimizer", "aggregation", "elastic_tensorflow_state", "elastic_keras_state",
         "elastic_object_state"]


@pytest.mark.parametrize("provider,size", [("shm", 2), ("tcp", 3)])
def test_horovod_semantics_on_every_rank(tmp_path, provider, size):
    run_workers(SCRIPT, size, provider, tmp_path, timeout=400)
    for r in range(size):
        report = json.loads((tmp_path / f"rank{r}.json").read_text())
        failed = {k: v for k, v in report.items() if v is not True}
        assert not failed, (r, failed)
        assert sorted(report) == sorted(CASES)
