"""The README's launch commands, as typed: taken from its text ("Training with
TensorFlow") and run from the repository by a user who is not root, with
Debian's default PATH (/usr/local/bin:/usr/bin:/bin), where `python` is not the
virtualenv's (bookworm has none at all). `train.py` is what the README says it
is, the reader's own script on Horovod's API: here one allreduce whose sum every
rank checks, and which says which interpreter ran it.

As root (CI), the commands run as `nobody` through setpriv; parent directories
that others cannot traverse (a clone under /root) are opened with o+x for the
run and restored afterwards."""
import os
import pwd
import re
import shlex
import stat
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEBIAN_PATH = "/usr/local/bin:/usr/bin:/bin"

TRAIN = '''\
import sys

import tensorflow as tf

import tf_plugin as hvd

hvd.init()
total = float(hvd.allreduce(tf.constant([float(hvd.rank() + 1)]), op=hvd.Sum).numpy()[0])
want = hvd.size() * (hvd.size() + 1) / 2
assert total == want, f"rank {hvd.rank()}: allreduce gave {total}, not {want}"
print(f"train.py: rank {hvd.rank()} of {hvd.size()} sum {total} prefix {sys.prefix}", flush=True)
hvd.shutdown()
'''


def launch_commands(readme: str) -> list[list[str]]:
    """The README's rdmatensor-run commands that start every rank on this
    host (no -H/--hosts), from the first shell block of its training section."""
    section = readme.split("## Training with TensorFlow", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    commands = [shlex.split(line, comments=True) for line in block.splitlines()]
    return [argv for argv in commands
            if argv and argv[0].endswith("rdmatensor-run")
            and not any(a in ("-H", "--hosts", "--hostfile", "-hostfile") or a.startswith("--hosts=") for a in argv)]


def test_launch_commands_are_found():
    commands = launch_commands((ROOT / "README.md").read_text())
    assert commands, "no local rdmatensor-run command in the README's training section"
    assert all("train.py" in argv for argv in commands), commands


def _open_parents(path: Path) -> list[tuple[Path, int]]:
    """Give others o+x on every parent of `path` that lacks it; return what to restore."""
    changed = []
    for parent in [path, *path.parents]:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            os.chmod(parent, stat.S_IMODE(mode) | stat.S_IXOTH)
            changed.append((parent, stat.S_IMODE(mode)))
    return changed


def test_readme_launch_commands_run_as_typed():
    commands = launch_commands((ROOT / "README.md").read_text())
    assert commands
    train = ROOT / "train.py"
    assert not train.exists(), f"{train} exists: this test writes its own train.py there and would overwrite it"
    as_user = []
    restore = []
    with tempfile.TemporaryDirectory(prefix="rdmatensor-readme-") as home:
        if os.geteuid() == 0:
            nobody = pwd.getpwnam("nobody")
            os.chown(home, nobody.pw_uid, nobody.pw_gid)
            as_user = ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups", "--"]
            restore = _open_parents(ROOT)
        try:
            train.write_text(TRAIN)
            train.chmod(0o644)
            for argv in commands:
                run = subprocess.run(as_user + argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                                     env={"PATH": DEBIAN_PATH, "HOME": home, "TF_CPP_MIN_LOG_LEVEL": "2"})
                out = run.stdout + run.stderr
                assert run.returncode == 0, f"{shlex.join(argv)} exited {run.returncode}:\n{out[-3000:]}"
                np_ = int(argv[argv.index("-np") + 1])
                ran = re.findall(r"train\.py: rank (\d+) of (\d+) sum \S+ prefix (\S+)", out)
                assert sorted(int(r) for r, _, _ in ran) == list(range(np_)), out[-3000:]
                assert {int(n) for _, n, _ in ran} == {np_}
                venv = os.path.realpath(ROOT / ".venv")
                assert {os.path.realpath(p) for _, _, p in ran} == {venv}, \
                    f"ranks ran under {sorted({p for _, _, p in ran})}, not the virtualenv {venv}"
                # the op library `make setup` built beside the package serves this user too: no
                # compiler ran into their own cache (it once did: a minute of g++ before the first step)
                cache = Path(home) / ".cache" / "rdmatensor"
                assert not cache.exists(), f"a library was built into {cache}: {sorted(os.listdir(cache))}"
        finally:
            train.unlink(missing_ok=True)
            for parent, mode in restore:
                os.chmod(parent, mode)
