"""Checkpoint and resume (tf_plugin README, "Checkpoint and resume"): a Keras fit
job, its rank 1 SIGKILLed at step 15 of 24, restarted from rank 0's last
ModelCheckpoint with hvd.load_model, ends with every model and optimizer
variable bit for bit equal to those of a job that was never interrupted (shm).
The killed run is also the shm case of test_rank_death.py."""
import glob
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from .processes import ROOT, lines_of

SCRIPT = Path(__file__).parent / "checkpoint_script.py"


def job(out_dir: Path, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "rdmatensor.runner.cli", "-np", "2", "--provider", "shm",
                           "--timeout", "150",
                           sys.executable, str(SCRIPT), str(out_dir), *map(str, args)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def test_a_job_killed_and_resumed_from_its_checkpoint_ends_bit_for_bit_like_an_uninterrupted_one(tmp_path):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    whole.mkdir()
    broken.mkdir()
    done = job(whole)
    assert done.returncode == 0, done.stderr[-4000:]

    killed = job(broken, 15)                    # epoch 3 of 4 (6 steps each), rank 0 saved epochs 1 and 2
    assert killed.returncode == 128 + 9, killed.stderr[-4000:]
    assert "rank 1 (worker 1 on localhost) was killed by signal 9 (SIGKILL): the first rank to fail" in killed.stderr
    rank0 = lines_of(killed.stdout + killed.stderr, 0)
    failed = [line for line in rank0 if line.startswith("failed ")]
    assert failed and "PeerLost: rank 1 was lost" in failed[0], killed.stderr[-4000:]
    print(f"shm, Keras fit: rank 0 raised {failed[0][:120]}")
    assert float(failed[0].split()[1]) < 10.0, failed[0][:300]
    job_id = next(line.split()[1] for line in rank0 if line.startswith("job "))
    assert not glob.glob(f"/dev/shm/rdmatensor-{job_id}-*")
    assert sorted(p.name for p in broken.glob("ckpt-*.keras")) == ["ckpt-1.keras", "ckpt-2.keras"]
    assert not (broken / "final.npz").exists()

    resumed = job(broken)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from epoch 2; trained to step 24" in lines_of(resumed.stdout, 0), resumed.stdout[-2000:]
    want, got = np.load(whole / "final.npz"), np.load(broken / "final.npz")
    assert want.files == got.files and len(want.files) == 10     # 4 weights, iterations, lr, 4 momenta
    for k in want.files:
        assert want[k].tobytes() == got[k].tobytes(), f"variable {k} differs after the resume"
    saved = np.load(broken / "final.npz")["arr_0"]
    import keras
    at_epoch_2 = keras.models.load_model(broken / "ckpt-2.keras", compile=False).variables[0]
    assert not np.array_equal(saved, np.asarray(at_epoch_2)), "nothing was trained after the resume"
