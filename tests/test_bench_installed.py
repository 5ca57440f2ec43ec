"""bench/ is installed as rdmatensor_bench (pyproject.toml), where no `bench`
package exists: every module imports under that name, and none names `bench`
absolutely, in an import or in the `python -m` line of a process it starts."""
import ast
import json
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
MODULES = sorted(p.stem for p in (REPO / "bench").glob("*.py") if p.stem != "__init__")


def test_every_bench_module_imports_under_its_installed_name(tmp_path):
    # -I and a foreign working directory: the checkout's bench/ is not on the path, the installed package is
    code = ("import importlib, importlib.util, json, sys\n"
            f"names = {MODULES!r}\n"
            "for name in names:\n"
            "    importlib.import_module('rdmatensor_bench.' + name)\n"
            "from rdmatensor_bench import model_grads\n"
            "print(json.dumps([importlib.util.find_spec('bench') is None, len(model_grads.names())]))\n")
    proc = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    no_bench, models = json.loads(proc.stdout.strip().splitlines()[-1])
    assert no_bench, "a `bench` package is importable: this test would not catch `import bench.*`"
    assert models >= 5


def test_every_data_file_of_bench_is_package_data():
    # an editable install reads the checkout, so only pyproject.toml tells what a wheel would carry
    import fnmatch
    import tomllib
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    data = [p.name for p in (REPO / "bench").iterdir() if p.is_file() and p.suffix not in (".py", ".pyc")]
    assert "model_grads.json" in data
    missing = [n for n in data if not any(fnmatch.fnmatch(n, pat) for pat in patterns.get("rdmatensor_bench", []))]
    assert not missing, f"pyproject.toml's package-data leaves {missing} out of rdmatensor_bench"


def test_no_bench_module_names_bench_absolutely():
    assert len(MODULES) >= 10
    found = []
    for name in MODULES:
        path = REPO / "bench" / f"{name}.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "bench":
                found.append(f"{path.name}:{node.lineno} from {node.module} import")
            elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "bench" for a in node.names):
                found.append(f"{path.name}:{node.lineno} import bench")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    re.fullmatch(r"bench(\.\w+)+", node.value):
                found.append(f"{path.name}:{node.lineno} {node.value!r}")     # e.g. [python, "-m", "bench.cli"]
    assert not found, "\n".join(found)
