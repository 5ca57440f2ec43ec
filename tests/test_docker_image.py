"""docker/Dockerfile builds the runtime image, with every compiled extension
setup.py declares, and its entry point runs.

Where a Docker daemon answers (`docker info`), the image is built from a clean
checkout and run. Where none does (this project's build machines), its twin is
built instead, and that always runs: the context is the tracked files (`git
archive HEAD`: a clean checkout, no build outputs) less what .dockerignore
excludes, and that checkout's Dockerfile is the one read: commit a change to
test it. The Dockerfile's COPY lines lay it out under a temporary root as the
image's tree, and its own RUN commands run there, its paths under /opt moved
under that root. Its apt-get line is checked as those packages being installed
here, not run. So that pip downloads no TensorFlow, the twin's virtualenv sees
the project's installed dependencies: a .pth file names a directory of links to
the entries of .venv's site-packages, less the project itself and pip's own
tooling, so pip finds `.[tf]`'s requirements satisfied and installs only the
project (its build requirements still come from the index, as in the image).
"""
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
IMAGE_ROOT = "/opt/"          # where the Dockerfile puts what it builds (WORKDIR, the virtualenv)
TOOLING = ("pip", "setuptools", "wheel", "_distutils_hack", "pkg_resources", "distutils-precedence.pth")


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per Dockerfile line, continuations joined, comments dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if pending and line.lstrip().startswith("#"):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        word, _, args = pending.strip().partition(" ")
        out.append((word.upper(), args.strip()))
        pending = ""
    return out


def _pattern(pattern: str) -> re.Pattern:
    """A .dockerignore pattern as Docker reads it (Go's filepath.Match, plus `**`)."""
    pattern = os.path.normpath(pattern.strip().lstrip("/"))
    rx, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            rx, i = rx + "(.*/)?", i + 3
            continue
        if pattern.startswith("**", i):
            rx, i = rx + ".*", i + 2
            continue
        rx += {"*": "[^/]*", "?": "[^/]"}.get(c, re.escape(c))
        i += 1
    return re.compile(rx + r"\Z")


def dockerignore(text: str):
    """A predicate: is this context path excluded (it, or a folder above it, matched last by a pattern)?"""
    rules = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            rules.append((line.startswith("!"), _pattern(line.lstrip("!"))))

    def excluded(path: str) -> bool:
        parts = path.strip("/").split("/")
        prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
        verdict = False
        for negated, rx in rules:
            if any(rx.match(p) for p in prefixes):
                verdict = not negated
        return verdict
    return excluded


def _excluded():
    path = ROOT / ".dockerignore"
    assert path.is_file(), ".dockerignore is missing: a build from a working tree would copy its build outputs"
    return dockerignore(path.read_text())


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def _has_git() -> bool:
    return shutil.which("git") is not None and (ROOT / ".git").exists()


def _prune(top: Path, excluded, remove: bool) -> list[str]:
    """The files under `top` that `excluded` keeps (excluded folders not entered); with `remove`, the rest deleted."""
    kept = []
    for folder, dirs, files in os.walk(top):
        rel = Path(folder).relative_to(top)
        for name in [d for d in dirs if excluded((rel / d).as_posix())]:
            dirs.remove(name)
            if remove:
                shutil.rmtree(Path(folder) / name)
        for name in files:
            if not excluded((rel / name).as_posix()):
                kept.append((rel / name).as_posix())
            elif remove:
                (Path(folder) / name).unlink()
    return kept


def context(into: Path) -> Path:
    """The build context of a clean checkout of HEAD, less what its .dockerignore excludes. With no git
    here (a copy of the sources, not a clone), the working tree less .dockerignore's, as `docker build` sends it."""
    if not _has_git():
        for name in _prune(ROOT, _excluded(), remove=False):
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, into / name, follow_symlinks=False)
        return into
    archive = subprocess.run(["git", "archive", "--format=tar", "HEAD"], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    ignore = into / ".dockerignore"
    assert ignore.is_file(), ".dockerignore is not committed: a build from a working tree would copy its outputs"
    _prune(into, dockerignore(ignore.read_text()), remove=True)
    return into


def _ignored_here() -> list[str]:
    """What .gitignore keeps out of git in this tree: its build outputs, caches and virtualenvs."""
    if _has_git():
        out = _git("ls-files", "--others", "--ignored", "--exclude-standard", "--directory").split("\n")
        return [p.rstrip("/") for p in out if p]
    patterns = [line.strip().rstrip("/") for line in (ROOT / ".gitignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    found = []
    for folder, dirs, files in os.walk(ROOT):
        rel = Path(folder).relative_to(ROOT)
        for name in dirs + files:
            if any(fnmatch.fnmatch((rel / name).as_posix() if "/" in p else name, p) for p in patterns):
                found.append((rel / name).as_posix())
                if name in dirs:
                    dirs.remove(name)
    return found


def declared_extensions(tree: Path = ROOT) -> list[str]:
    """The extension modules setup.py builds on this machine, from setup.py itself."""
    probe = ("import setuptools, sys; setuptools.setup = lambda **kw: print("
             "'\\n'.join(e.name for e in kw['ext_modules'])); sys.argv = ['setup.py']; "
             "exec(compile(open('setup.py').read(), 'setup.py', 'exec'))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tree, capture_output=True, text=True, check=True).stdout
    names = out.split()
    assert names, "setup.py declares no extension"
    return names


def test_dockerignore_keeps_build_outputs_out():
    """Everything git ignores here (virtualenvs, in-place .so files, caches, build/) stays out of the context."""
    excluded = _excluded()
    ignored = _ignored_here()
    for probe in (".venv", ".venv-horovod", "build", "test-results", "rdmatensor.egg-info",
                  "rdmatensor/session/_slots.cpython-311-x86_64-linux-gnu.so", "tf_plugin/__pycache__"):
        ignored.append(probe)
    assert [p for p in ignored if not excluded(p)] == []
    assert not excluded("setup.py") and not excluded("rdmatensor/session/_slots.c")


def test_dockerfile_copies_what_setup_py_builds():
    copied = set()
    for word, args in instructions(DOCKERFILE.read_text()):
        if word == "COPY":
            copied.update(shlex.split(args)[:-1])
    for needed in ("setup.py", "pyproject.toml"):
        assert needed in copied, f"docker/Dockerfile never copies {needed}"


def _docker_daemon() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


def _check_native(python: list[str], cwd, declared: list[str]) -> dict:
    """Where the package and each declared extension load from, and what the package runs (native.built())."""
    probe = ("import importlib, json, sys, rdmatensor; from rdmatensor import native; "
             "print(json.dumps({'file': rdmatensor.__file__, 'built': native.built(), "
             "'extensions': {n: importlib.import_module(n).__file__ for n in sys.argv[1:]}}))")
    run = subprocess.run(python + ["-c", probe, *declared], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    state = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(state["built"]) == len(declared), state
    assert all(why is None for why in state["built"].values()), f"a compiled part does not run: {state}"
    assert all(f.endswith(".so") for f in state["extensions"].values()), state
    return state


def test_image_builds_with_its_extensions_and_runs():
    if _docker_daemon():
        _build_with_docker()
    else:
        _build_twin()


def _build_with_docker():
    tag = f"rdmatensor-test:{uuid.uuid4().hex[:12]}"
    with tempfile.TemporaryDirectory(prefix="rdmatensor-docker-") as tmp:
        context(Path(tmp))
        subprocess.run(["docker", "build", "-q", "-f", "docker/Dockerfile", "-t", tag, "."], cwd=tmp,
                       check=True, timeout=3600)
    try:
        run = subprocess.run(["docker", "run", "--rm", tag], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
        _check_native(["docker", "run", "--rm", "--entrypoint", "python", tag], None, declared_extensions())
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)


def _dependencies_view(into: Path) -> Path:
    """Links to .venv's installed distributions, less the project and pip's tooling."""
    site = next((ROOT / ".venv" / "lib").glob("python3*/site-packages"))
    into.mkdir()
    for entry in site.iterdir():
        name = entry.name.lower()
        if name.startswith(("__editable__", "rdmatensor", "__pycache__")) or name.startswith(TOOLING):
            continue
        (into / entry.name).symlink_to(entry)
    return into


def _build_twin():
    with tempfile.TemporaryDirectory(prefix="rdmatensor-image-") as tmp:
        tmp = Path(tmp)
        ctx, root = tmp / "context", tmp / "image"
        ctx.mkdir()
        root.mkdir()
        steps = instructions((context(ctx) / "docker" / "Dockerfile").read_text())
        declared = declared_extensions(ctx)
        deps = _dependencies_view(tmp / "deps")

        def image(path: str) -> str:      # the image's /opt/... under the twin's root
            return re.sub(rf"(?<![\w./-]){re.escape(IMAGE_ROOT)}", str(root) + IMAGE_ROOT, path)

        env = {k: v for k, v in os.environ.items()          # this host's network settings, not its Python's
               if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIP_REQUIRE"))}
        env["HOME"] = str(tmp)
        workdir = root
        entry, cmd = [], []
        for word, args in steps:
            if word == "WORKDIR":
                workdir = Path(image(args))
                workdir.mkdir(parents=True, exist_ok=True)
            elif word == "ENV":
                key, _, value = args.partition("=")
                env[key] = image(value.replace(f"${key}", env.get(key, "")))
            elif word == "COPY":
                *srcs, dest = shlex.split(args)
                assert not any(s.startswith("--") for s in srcs), f"COPY flags not handled here: {args}"
                dest = Path(image(dest)) if dest.startswith("/") else workdir / dest
                for src in srcs:
                    if (ctx / src).is_dir():
                        shutil.copytree(ctx / src, dest, dirs_exist_ok=True, symlinks=True)
                    else:
                        assert (ctx / src).is_file(), f"COPY {src}: not in the build context"
                        target = dest / src if len(srcs) > 1 or args.rstrip().endswith("/") else dest
                        target.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(ctx / src, target)
            elif word == "RUN" and "apt-get install" in args:
                install = args.split("apt-get install", 1)[1].split("&&", 1)[0]
                packages = [w for w in install.split() if not w.startswith("-")]
                missing = [p for p in packages
                           if "install ok installed" not in subprocess.run(
                               ["dpkg-query", "-W", "-f=${Status}", p], capture_output=True, text=True).stdout]
                assert packages and not missing, f"the image's Debian packages not installed here: {missing}"
            elif word == "RUN":
                run = subprocess.run(["bash", "-c", image(args)], cwd=workdir, env=env, capture_output=True,
                                     text=True, timeout=900)
                assert run.returncode == 0, f"RUN {args}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
                for cfg in root.rglob("pyvenv.cfg"):        # a new virtualenv: let it see the dependencies
                    for site in cfg.parent.glob("lib/python3*/site-packages"):
                        (site / "rdmatensor-test-dependencies.pth").write_text(f"{deps}\n")
            elif word == "ENTRYPOINT":
                entry = json.loads(args)
            elif word == "CMD":
                cmd = json.loads(args)

        app = workdir
        for name in declared:
            where = app / Path(*name.split("."))
            assert list(where.parent.glob(where.name + ".*.so")), f"{name} not built in the image's tree"
        python = shutil.which("python", path=env["PATH"])
        assert python and python.startswith(str(root)), f"the image's python is {python}"
        state = _check_native([python], "/", declared)      # from /: the installed package, not a folder
        assert state["file"].startswith(str(app)), state
        assert all(f.startswith(str(app)) for f in state["extensions"].values()), state

        assert entry, "docker/Dockerfile has no ENTRYPOINT"
        run = subprocess.run(entry + cmd, cwd=app, env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, f"{entry + cmd} exited {run.returncode}:\n{run.stdout}{run.stderr}"
        assert shutil.which(entry[0], path=env["PATH"]).startswith(str(root))
