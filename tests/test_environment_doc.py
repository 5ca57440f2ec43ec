"""docs/environment.md names every environment variable the code reads or sets,
and Horovod's settings under both names, as tf_plugin/core/settings.py has them.

A variable is found wherever the code names one: the key of os.environ[...],
.get, .pop, .setdefault, os.getenv, `in os.environ` and of any mapping whose
name says env (`env[...] = `); the keywords of dict(os.environ, ...) and
.update(...); the keys of a dict literal given as env= or assigned to an env;
a module constant holding a name used in any of those (`ENDPOINT_ENV`); in any
string, f-strings included, a `NAME=` assignment, an `export` or an `-x`, and
every name with a prefix only environment variables carry here; and in the
shell (scripts/, the SoftRoCE VM's init, docker/, the Makefile's recipes)
every `$NAME` read and `NAME=` set, and the `name:` of a Kubernetes env entry."""
import ast
import pathlib
import re

from tf_plugin.core import settings

REPO = pathlib.Path(__file__).resolve().parents[1]
DOC = (REPO / "docs" / "environment.md").read_text()
PYTHON_TREES = ("rdmatensor", "tf_plugin", "bench", "examples", "scripts")
NAME = re.compile(r"[A-Z][A-Z0-9_]*")
# Prefixes that only environment variables carry in this tree
PREFIXED = re.compile(r"(?<![\w$])((?:RDMATENSOR|HOROVOD|TF_PLUGIN|TF|SLURM|OMPI_COMM_WORLD|RDT|XDG)_\w*[A-Z0-9])\b")
ASSIGNED = re.compile(r"(?:^|[\s;'\"(])(?:export\s+|-x\s+)?([A-Z][A-Z0-9_]*)=")
READ = re.compile(r"\$\{?([A-Z][A-Z0-9_]*)(?![\w(])")
KUBERNETES_ENV = re.compile(r"\bname:\s*([A-Z][A-Z0-9_]*)\b")
SHELL_OWN = {"PWD", "IFS"}          # the shell's own, no setting


def _envish(node) -> bool:
    return "env" in ast.unparse(node).lower()


def _constants(trees) -> dict[str, str]:
    """Module constants holding a variable's name: NAME = "VAR" and NAME, OTHER = "VAR", "VAR2"."""
    out = {}
    for tree in trees:
        for node in ast.walk(tree):
            if not isinstance(node, ast.Assign):
                continue
            for target in node.targets:
                pairs = [(target, node.value)]
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs = list(zip(target.elts, node.value.elts, strict=False))
                for name, value in pairs:
                    if isinstance(name, ast.Name) and isinstance(value, ast.Constant) \
                            and isinstance(value.value, str) and NAME.fullmatch(value.value):
                        out[name.id] = value.value
    return out


def _key(node, constants):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, (ast.Name, ast.Attribute)):
        return constants.get(node.id if isinstance(node, ast.Name) else node.attr)
    return None


def _keys_in_env_uses(tree, constants):
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and _envish(node.value):
            yield _key(node.slice, constants)
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)) \
                and _envish(node.comparators[0]):
            yield _key(node.left, constants)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and any(map(_envish, node.targets)):
            yield from (_key(k, constants) for k in node.value.keys if k is not None)
        elif isinstance(node, ast.Call):
            f = node.func
            method = f.attr if isinstance(f, ast.Attribute) else None
            if node.args and (method in ("getenv", "putenv", "unsetenv")
                              or (method in ("get", "pop", "setdefault") and _envish(f.value))):
                yield _key(node.args[0], constants)
            if (isinstance(f, ast.Name) and f.id == "dict" and node.args and _envish(node.args[0])) \
                    or (method == "update" and _envish(f.value)):
                yield from (k.arg for k in node.keywords if k.arg)
                for arg in node.args:
                    if isinstance(arg, ast.Dict):
                        yield from (_key(k, constants) for k in arg.keys if k is not None)
            for kw in node.keywords:
                if kw.arg == "env" and isinstance(kw.value, ast.Dict):
                    yield from (_key(k, constants) for k in kw.value.keys if k is not None)
                elif kw.arg == "env" and isinstance(kw.value, ast.Call) and getattr(kw.value.func, "id", "") == "dict":
                    yield from (k.arg for k in kw.value.keywords if k.arg)


def _strings(tree):
    """Every string constant, the literal parts of f-strings included."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value


def names_in_python() -> dict[str, set[str]]:
    paths = [p for tree in PYTHON_TREES for p in sorted((REPO / tree).rglob("*.py"))]
    trees = {p: ast.parse(p.read_text()) for p in paths}
    constants = _constants(trees.values())
    found: dict[str, set[str]] = {}
    for path, tree in trees.items():
        names = {k for k in _keys_in_env_uses(tree, constants) if k and NAME.fullmatch(k)}
        for text in _strings(tree):
            names |= set(PREFIXED.findall(text)) | set(ASSIGNED.findall(text))
        for name in names:
            found.setdefault(name, set()).add(path.relative_to(REPO).as_posix())
    return found


def names_in_shell() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    files = [*sorted((REPO / "scripts").glob("*.sh")), *sorted((REPO / "rdmatensor").rglob("*.sh")),
             *sorted(p for p in (REPO / "docker").iterdir() if p.is_file()), REPO / "Makefile"]
    for path in files:
        for line in path.read_text().splitlines():
            if path.name == "Makefile":
                if not line.startswith("\t") and not line.startswith("  "):
                    continue                      # make's own variables; recipes are shell
                line = line.replace("$$", "$")
            if line.lstrip().startswith("#"):
                continue
            names = ASSIGNED.findall(line) + READ.findall(line) + PREFIXED.findall(line)
            if path.suffix == ".yaml":
                names += KUBERNETES_ENV.findall(line)
            for name in names:
                found.setdefault(name, set()).add(path.relative_to(REPO).as_posix())
    return found


def every_name() -> dict[str, set[str]]:
    found = names_in_python()
    for name, where in names_in_shell().items():
        found.setdefault(name, set()).update(where)
    return {n: w for n, w in found.items() if n not in SHELL_OWN}


def test_every_variable_in_the_code_is_on_the_page():
    names = every_name()
    # the collector sees each way of naming one: a literal key, a constant, a torchrun name, an f-string, the shell
    for seen in ("RDMATENSOR_TOKEN", "RDMATENSOR_VERBS_ENDPOINT", "WORLD_SIZE", "RDMATENSOR_VM_ADDRS", "RDT_MTU",
                 "MASTER_PORT", "XDG_CACHE_HOME", "TF_CPP_MIN_LOG_LEVEL", "PYTHON"):
        assert seen in names, seen
    missing = sorted(f"{n} ({', '.join(sorted(w))})" for n, w in names.items() if f"`{n}`" not in DOC)
    assert not missing, "docs/environment.md does not name:\n" + "\n".join(missing)


def test_the_collector_finds_each_way_of_naming_a_variable():
    code = ('import os\nVAR = "RDMATENSOR_A_CONSTANT"\nos.environ.get(VAR)\nos.environ["PLAIN_KEY"]\n'
            'env = {"DICT_KEY": "1"}\nrun(x, env=dict(os.environ, KEYWORD_KEY="1"))\nos.getenv("GETENV_KEY")\n'
            'f"export IN_FSTRING={x} AND_ANOTHER={y}"\n"IN_ENV" in os.environ\nenv.setdefault("SET_DEFAULT", "1")\n')
    tree = ast.parse(code)
    constants = _constants([tree])
    found = {k for k in _keys_in_env_uses(tree, constants) if k}
    for text in _strings(tree):
        found |= set(PREFIXED.findall(text)) | set(ASSIGNED.findall(text))
    assert found >= {"RDMATENSOR_A_CONSTANT", "PLAIN_KEY", "DICT_KEY", "KEYWORD_KEY", "GETENV_KEY", "IN_FSTRING",
                     "AND_ANOTHER", "IN_ENV", "SET_DEFAULT"}, found
    assert READ.findall("x=${MAKE_VAR:-1} $SHELL_VAR $(cmd) ${Status}") == ["MAKE_VAR", "SHELL_VAR"]


def test_horovods_settings_under_both_names_and_the_ignored_ones():
    for s in settings.SETTINGS:
        row = next((line for line in DOC.splitlines() if line.startswith(f"| `{s.name}` |")), "")
        assert f"`{s.horovod}`" in row, s.name
    for var in (*settings.IGNORED, *settings.NEEDLESS):
        assert f"`{var}`" in DOC, var
