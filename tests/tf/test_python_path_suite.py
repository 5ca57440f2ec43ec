"""A focused set of the TF tests run again on the Python path (RDMATENSOR_TF_OPS=python;
the rest of tests/tf runs on the default, the native ops wherever they apply: ranks
on one host over shm): Keras fit, a rank killed mid-training over shm, broken
scripts' typed errors, process sets, autograph. Each calls the test of its file as
it is, so both paths keep the same promises. The Python path also serves every job
across hosts, over tcp or verbs, elastic, or with a time line: those tests run on
it anyway."""
import pytest

from . import test_hostile_inputs, test_keras_fit, test_process_sets, test_rank_death, test_tracing


@pytest.fixture(autouse=True)
def python_path(monkeypatch):
    monkeypatch.setenv("RDMATENSOR_TF_OPS", "python")


def test_keras_fit_on_the_python_path(tmp_path):
    test_keras_fit.test_keras_fit_with_distributed_optimizer_and_callbacks(tmp_path)


def test_a_killed_rank_on_the_python_path(tmp_path):
    test_rank_death.test_a_rank_killed_mid_training_fails_the_job_fast_and_clean(tmp_path, "shm", "ring", 2, 0)


def test_broken_scripts_on_the_python_path(tmp_path, monkeypatch):
    test_hostile_inputs.test_broken_scripts_get_typed_errors_naming_the_tensor_and_the_rank(tmp_path, monkeypatch)


def test_process_sets_on_the_python_path(tmp_path):
    test_process_sets.test_process_sets_run_among_their_ranks_only(tmp_path)


def test_autograph_on_the_python_path():
    test_tracing.test_autograph_rewrites_the_users_step_but_none_of_the_plugin()
