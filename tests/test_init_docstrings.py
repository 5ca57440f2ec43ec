"""Each package's __init__.py lists its files, as the README's layout section
says: every module, compiled or C source, data file and subpackage beside it
is named in its docstring (a module by its file name or its bare name)."""
import ast
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
BUILT = (".so", ".pyc")


def packages():
    return sorted(p.parent for tree in ("rdmatensor", "tf_plugin", "bench") for p in (REPO / tree).rglob("__init__.py"))


def test_every_package_docstring_lists_its_files():
    unlisted = []
    for package in packages():
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
        for entry in sorted(package.iterdir()):
            if entry.name in ("__init__.py", "__pycache__") or entry.name.startswith(".") or entry.suffix in BUILT:
                continue
            if entry.is_dir():
                named = f"{entry.name}/" in doc
            else:
                named = entry.name in doc or (entry.suffix == ".py" and re.search(rf"\b{entry.stem}\b", doc))
            if not named:
                unlisted.append(entry.relative_to(REPO).as_posix())
    assert len(packages()) >= 18
    assert not unlisted, "not listed in their package's __init__.py docstring: " + ", ".join(unlisted)


def layout_rows() -> list[list[str]]:
    """The README's layout table: the paths of each row, resolved against the tree."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows, top = [], ""
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cell = line.split(" | ", 1)[0][2:]
        tokens = [t.strip() for t in re.findall(r"`([^`]+)`", cell)]
        if cell.startswith("`  "):                     # an indented row: inside the last top-level folder
            paths = [top + t for t in tokens]
        else:                                         # the first path from the root, the rest beside it
            first = tokens[0]
            base = first.rstrip("/").rpartition("/")[0]
            paths = [first] + [f"{base}/{t}" if base else t for t in tokens[1:]]
            top = first if first.endswith("/") else top
        rows.append(paths)
    return rows


def module_of(path: str) -> str:
    parts = path.rstrip("/").removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_readmes_layout_lists_every_folder_in_layer_order():
    from tests.test_layout import LEVEL, part_of

    rows = layout_rows()
    listed = {p for row in rows for p in row}
    for path in listed:
        assert (REPO / path).exists(), f"the README's layout names {path}, which does not exist"
    missing = [f"{p.relative_to(REPO).as_posix()}/" for p in packages()
               if f"{p.relative_to(REPO).as_posix()}/" not in listed and p.name not in ("rdmatensor", "tf_plugin")]
    assert not missing, f"the README's layout lacks {missing}"
    levels = []
    for row in rows:
        parts = [part_of(module_of(p)) for p in row]
        if parts[0] is None:
            assert row == rows[-1], f"{row}: only the last row may be outside the layers"
            continue
        assert None not in parts, row
        levels.append((min(LEVEL[p] for p in parts), max(LEVEL[p] for p in parts), row))
    for (_, high, row), (low, _, below) in zip(levels, levels[1:], strict=False):
        assert high <= low, f"{below} is listed after {row}, though it is a lower layer"
    assert {LEVEL[part_of(module_of(p))] for row in rows[:-1] for p in row} == set(LEVEL.values())
