"""tf_plugin's layers: launcher, engine, the Horovod face, then what users run.
An import that runs upward (the engine reaching into the Horovod face, the
launcher into the training benchmark) is a cycle waiting to happen."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "tf_plugin"
LAYER = {"launcher": 0, "engine": 1, "horovod": 2, "keras": 3, "parameter_server": 3, "training": 3}


def part_of(module: str) -> str | None:
    """'tf_plugin.engine.ring' -> 'engine'; the package root itself -> None."""
    names = module.split(".")
    return names[1].removesuffix(".py") if len(names) > 1 else None


def imports_of(path: pathlib.Path):
    package = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
                targets = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
            else:
                targets = [node.module or ""]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for target in targets:
            if target == "tf_plugin" or target.startswith("tf_plugin."):
                yield node.lineno, target


def test_every_module_belongs_to_a_layer():
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts == ("__init__.py",):
            continue
        assert rel.parts[0].removesuffix(".py") in LAYER, f"{rel}: not in any layer of tf_plugin"


def test_no_import_runs_upward():
    upward = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts == ("__init__.py",):
            continue      # the package root loads the Horovod face lazily, by name
        mine = rel.parts[0].removesuffix(".py")
        for line, target in imports_of(path):
            theirs = part_of(target)
            if theirs is None:
                upward.append(f"{rel}:{line} imports the package root")
            elif theirs != mine and LAYER[theirs] >= LAYER[mine]:
                upward.append(f"{rel}:{line} ({mine}) imports {target} ({theirs})")
    assert not upward, "\n".join(upward)
