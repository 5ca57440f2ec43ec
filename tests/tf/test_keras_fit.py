"""`import tf_plugin.keras as hvd`: a Keras 3 script written for horovod.tensorflow.keras
(DistributedOptimizer, the three callbacks, a checkpoint on rank 0) runs with only its
import changed, each rank a process of its own, over shm."""
import json
from pathlib import Path

import numpy as np

from .processes import run_workers

SCRIPT = Path(__file__).parent / "horovod_keras_script.py"


def test_keras_fit_with_distributed_optimizer_and_callbacks(tmp_path):
    run_workers(SCRIPT, 2, "shm", tmp_path)
    reps = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, rep in enumerate(reps):
        # different initial weights, broadcast by the callback: bit-identical weights and optimizer state
        assert rep["trained_same"] and rep["iterations"] == 3 * rep["steps_per_epoch"]
        # the logs History keeps hold the metric averaged over the ranks
        np.testing.assert_allclose(rep["history"], np.mean(rep["all_local_losses"], axis=0), rtol=1e-6)
        assert rep["local_losses"] == rep["all_local_losses"][rank] and rep["history"] != rep["local_losses"]
        # warmup: from initial_lr / size to initial_lr over 2 epochs, batch by batch, then held
        steps, lrs = rep["steps_per_epoch"], rep["lrs"]
        assert np.isclose(lrs[0], 0.1 / 2 * (1 + 1 / steps / 2)) and np.all(np.diff(lrs[:2 * steps]) > 0)
        np.testing.assert_allclose(lrs[2 * steps - 1:], 0.1, rtol=1e-6)
        # control calls: constant within the first epoch, once more for the metrics at its end, then constant
        calls = rep["calls"]
        assert calls[:steps] == [calls[0]] * steps and calls[steps:] == [calls[steps]] * (len(calls) - steps)
        # backward_passes_per_step=2: one update (and one collective) per two batches, ranks identical,
        # and, as in Horovod, every backward pass counts as an iteration;
        # a new model of the same architecture: its broadcast moves what the first model's did, a set
        # already planned (sets are keyed by what they move, not by names); its aggregated gradients
        # extend the plan once
        assert rep["aggregated_iterations"] == steps and rep["aggregated_same"]
        assert rep["aggregated_extensions"] == 1
        # hvd.init(model) planned the gradients ahead: fit only added the variables of model and
        # optimizer (the callback's broadcast) and the metrics
        assert rep["planned_ahead_generations"] == 1 and rep["fit_extensions"] == 2
    assert reps[0]["checkpoint_matches"] is True
    assert (tmp_path / "ckpt.weights.h5").exists()
