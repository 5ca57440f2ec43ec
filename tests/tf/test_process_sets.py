"""Horovod's process sets over 3 ranks (process_sets_script.py): collectives among
some ranks only return exact values and leave the global set's alone; Horovod's
errors for a rank outside a set, a set never registered, a root outside the set
and a duplicate; sets added and removed after init(); the tape and a TF1
optimizer over a set."""
import json
from pathlib import Path

from .processes import run_workers

SCRIPT = Path(__file__).parent / "process_sets_script.py"


def test_process_sets_run_among_their_ranks_only(tmp_path):
    run_workers(SCRIPT, 3, "shm", tmp_path, timeout=240)
    for r in range(3):
        rep = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert rep["ids"] == [1, 2, None], rep["ids"]          # the duplicate of a set is left unregistered
        assert rep["sizes"] == [2, 1] and rep["set_rank"] == {0: 0, 1: 0, 2: 1}[r]
        assert rep["included"] == [r != 1, r == 1] and rep["size_op"] == 2 and rep["included_op"] == int(r != 1)
        assert all(rep["checks"].values()) and len(rep["checks"]) == 25 + (r != 2), rep["checks"]
        errors = rep["errors"]
        assert f"rank {r} is not in process set" in errors["not_member"], errors
        assert "is not a registered process set" in errors["unregistered"], errors
        assert "is not in process set" in errors["root_outside"], errors
        assert "duplicate process set" in errors["duplicate"], errors
        assert rep["pair_id"] == 3 and rep["removed"] == [True, False] and rep["pair_after"] is None
