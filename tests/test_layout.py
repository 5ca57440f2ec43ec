"""The tree keeps explaining itself: imports run only down its layers and never
in a circle, the framework-free part loads no TensorFlow (judged by what a
fresh process has loaded, not by import lines), and every compiled extension
still builds, installs and loads where its Python side looks for it."""
import ast
import json
import os
import pathlib
import re
import subprocess
import sys
import tomllib

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("rdmatensor", "tf_plugin", "bench")

# Lowest first; a module may import its own layer or lower ones, never higher.
# A part is named by its dotted prefix, the longest that matches wins.
LAYERS = [
    {"rdmatensor.errors", "rdmatensor.native", "rdmatensor.streaming", "rdmatensor.plan", "rdmatensor.memory",
     "rdmatensor.devices", "rdmatensor.environment"},
    {"rdmatensor.control"},
    {"rdmatensor.providers"},
    {"rdmatensor.session"},
    {"rdmatensor"},                                             # the package's public names (its __init__)
    {"rdmatensor.softroce", "rdmatensor.runner"},
    {"rdmatensor.cli", "rdmatensor.__main__"},
    {"tf_plugin.errors"},                                       # every error of the plugin, TensorFlow's types lazily
    # the framework-free basics under both the executor and the planner
    {"tf_plugin.core.settings", "tf_plugin.core.buffers", "tf_plugin.core.scaling", "tf_plugin.core.meter",
     "tf_plugin.core.timeline"},
    {"tf_plugin.executor", "tf_plugin.native"},     # runs a plan: the ring, the comm thread, the native all-reduce
    {"tf_plugin.core"},
    {"tf_plugin.graph"},
    {"tf_plugin.horovod"},
    {"tf_plugin.keras", "tf_plugin.parameter_server", "tf_plugin.training", "tf_plugin.launcher", "tf_plugin"},
    {"bench"},
]
LEVEL = {part: i for i, parts in enumerate(LAYERS) for part in parts}

# Modules that must not load TensorFlow (nor Keras) when imported.
FRAMEWORK_FREE = ("rdmatensor", "tf_plugin.errors", "tf_plugin.core", "tf_plugin.executor", "tf_plugin.horovod.world",
                  "tf_plugin.launcher")


def module_of(path: pathlib.Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, pathlib.Path]:
    return {module_of(p): p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))}


def part_of(module: str) -> str | None:
    names = module.split(".")
    for n in range(len(names), 0, -1):
        if ".".join(names[:n]) in LEVEL:
            return ".".join(names[:n])
    return None


def imports(modules: dict[str, pathlib.Path]):
    """(module, line, imported module of this tree) for every import, inside functions too."""
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = ".".join(base[:len(base) - node.level + 1])
                    target = f"{base}.{node.module}" if node.module else base
                else:
                    target = node.module or ""
                # `from package import module` imports the module
                found = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
                targets = found or [target]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != module:
                    yield module, node.lineno, target


def test_every_module_has_a_layer():
    assert not [m for m in sources() if part_of(m) is None], "modules in no layer"


def test_no_import_runs_upward():
    upward = [f"{m}:{line} imports {t} (layer {LEVEL[part_of(t)]} above {LEVEL[part_of(m)]})"
              for m, line, t in imports(sources()) if LEVEL[part_of(t)] > LEVEL[part_of(m)]]
    assert not upward, "\n".join(upward)


def test_no_import_circle():
    modules = sources()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for m, _, t in imports(modules):
        # a package's own __init__ importing its children lazily is how registries load; leave it out
        if not t.startswith(m + "."):
            graph[m].add(t)
    # Tarjan's strongly connected components
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_the_framework_free_part_loads_no_tensorflow():
    """Each framework-free module imported in turn in one fresh process: the first
    one after which TensorFlow or Keras is loaded is named."""
    names = sorted(m for m in sources() if m.startswith(FRAMEWORK_FREE) and not m.endswith("__main__"))
    assert "tf_plugin.core.world" in names and "rdmatensor.runner.cli" in names
    code = ("import importlib, json, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "    heavy = sorted(m for m in ('tensorflow', 'keras') if m in sys.modules)\n"
            "    if heavy:\n"
            "        print(json.dumps([name, heavy])); break\n"
            "else:\n"
            "    print(json.dumps(None))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) is None, f"loads a framework: {proc.stdout}"


def test_the_launcher_package_binds_no_core_and_needs_no_tf_plugin():
    code = ("import os, sys; before = os.sched_getaffinity(0); "
            "os.environ.update(RDMATENSOR_BIND_TO='core', RDMATENSOR_HOST_SLOT='0/2'); "
            "import rdmatensor.runner.cli, rdmatensor.runner.elastic; "
            "assert os.sched_getaffinity(0) == before; "
            "assert not [m for m in sys.modules if m.startswith('tf_plugin')]; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.stdout.strip() == "ok", proc.stderr
    example = (REPO / "examples" / "all_pairs.py").read_text()
    assert not re.search(r"^\s*(from|import) tf_plugin", example, re.M)


def test_every_compiled_extension_is_built_installed_and_loaded():
    """Each C source under rdmatensor/ is an extension of setup.py (which pip and make
    setup build), shipped by pyproject.toml's package data when built in place, has
    the init function of its name, and is importable as the module its Python side
    loads: a move that misses one would silently leave the Python twin running."""
    sources_c = sorted((REPO / "rdmatensor").rglob("_*.c"))
    assert len(sources_c) >= 5
    build = (REPO / "setup.py").read_text()
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    shipped = config["tool"]["setuptools"]["package-data"]["rdmatensor"]
    packages = set(config["tool"]["setuptools"]["packages"])
    for init in (REPO / "rdmatensor").rglob("__init__.py"):
        assert module_of(init) in packages, f"{module_of(init)} is not in pyproject.toml's packages"
    names = []
    for c in sources_c:
        rel = c.relative_to(REPO).as_posix()
        assert f'Extension("{module_of(c)}", ["{rel}"]' in build, f"setup.py does not build {rel}"
        in_package = c.relative_to(REPO / "rdmatensor").with_suffix("").as_posix()
        assert f"{in_package}*.so" in shipped, f"pyproject.toml does not ship {in_package}*.so"
        text = c.read_text()
        stem = c.stem
        assert f"PyInit_{stem}(" in text, f"{rel}: its init function is not PyInit_{stem}"
        names.append(module_of(c))
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "from rdmatensor import streaming\n"
            "from rdmatensor.providers.shm import completion_ring\n"
            "from rdmatensor.providers.tcp import inbox\n"
            "from rdmatensor.providers.verbs import native_endpoint\n"
            "from rdmatensor.session import slots\n"
            "loaded = (streaming, completion_ring, inbox, native_endpoint, slots)\n"
            "errors = {m.__name__: m.BUILD_ERROR for m in loaded}\n"
            "assert not any(errors.values()), errors\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_job_files_written_before_the_move_still_run():
    """`python -m tf_plugin.launcher.run` and `...cluster` forward to rdmatensor.runner."""
    run = subprocess.run([sys.executable, "-m", "tf_plugin.launcher.run", "-np", "2", sys.executable, "-c",
                          "import os; print('rank', os.environ['RDMATENSOR_RANK'])"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert run.returncode == 0 and "[0] rank 0" in run.stdout and "[1] rank 1" in run.stdout, run.stderr
    config = json.dumps({"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 1}})
    cluster = subprocess.run([sys.executable, "-m", "tf_plugin.launcher.cluster"], capture_output=True, text=True,
                             cwd=REPO, timeout=120, env={**os.environ, "TF_CONFIG": config})
    assert cluster.returncode == 0 and json.loads(cluster.stdout)["task"] == {"type": "worker", "index": 1}, \
        cluster.stderr
