"""docs/environment.md names every environment variable the code reads or sets,
and Horovod's settings under both names, as tf_plugin/core/settings.py has them."""
import pathlib
import re

from tf_plugin.core import settings

REPO = pathlib.Path(__file__).resolve().parents[1]
DOC = (REPO / "docs" / "environment.md").read_text()


def test_every_variable_in_the_code_is_on_the_page():
    names = set()
    for package in ("rdmatensor", "tf_plugin", "bench"):
        for path in (REPO / package).rglob("*.py"):
            names |= set(re.findall(r"[\"']((?:RDMATENSOR|HOROVOD|TF_PLUGIN)_[A-Z0-9_]+)[\"']", path.read_text()))
    assert len(names) > 40
    missing = sorted(n for n in names if f"`{n}`" not in DOC)
    assert not missing, f"docs/environment.md does not name {missing}"


def test_horovods_settings_under_both_names_and_the_ignored_ones():
    for s in settings.SETTINGS:
        row = next((line for line in DOC.splitlines() if line.startswith(f"| `{s.name}` |")), "")
        assert f"`{s.horovod}`" in row, s.name
    for var in settings.IGNORED:
        assert f"`{var}`" in DOC, var
