"""A focused set of the TF tests run again on the native path (RDMATENSOR_TF_OPS=native;
the rest of tests/tf runs on the Python path, the default): Keras fit, a rank
killed mid-training (the native groups abort with the job, naming the lost rank,
within the peer timeout), broken scripts' typed errors, process sets, autograph.
Each calls the test of the Python path's file as it is, so both paths keep the
same promises."""
import pytest

from . import test_hostile_inputs, test_keras_fit, test_process_sets, test_rank_death, test_tracing


@pytest.fixture(autouse=True)
def native(monkeypatch):
    monkeypatch.setenv("RDMATENSOR_TF_OPS", "native")


def test_keras_fit_on_the_native_path(tmp_path):
    test_keras_fit.test_keras_fit_with_distributed_optimizer_and_callbacks(tmp_path)


def test_a_killed_rank_on_the_native_path(tmp_path):
    test_rank_death.test_a_rank_killed_mid_training_fails_the_job_fast_and_clean(tmp_path, "shm", "ring", 2, 0)


def test_broken_scripts_on_the_native_path(tmp_path, monkeypatch):
    test_hostile_inputs.test_broken_scripts_get_typed_errors_naming_the_tensor_and_the_rank(tmp_path, monkeypatch)


def test_process_sets_on_the_native_path(tmp_path):
    test_process_sets.test_process_sets_run_among_their_ranks_only(tmp_path)


def test_autograph_on_the_native_path():
    test_tracing.test_autograph_rewrites_the_users_step_but_none_of_the_plugin()
