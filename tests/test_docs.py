"""The user's documents: README's settings reference matches the schema; no lab-notebook wording."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from ktlong import config, configdoc

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
USER_DOCS = [README, *sorted(p for p in (ROOT / "docs").iterdir()
                             if p.is_file() and p.suffix in (".md", ".sh")),
             *sorted((ROOT / "profiles").glob("*.yaml"))]
# "session 9", "sessions 3-7", "run 12", "runs 18-22"; a flag such as `--decode-runs 5` is fine
NOTEBOOK = re.compile(r"(?<![-\w])(sessions?|runs?) [0-9]", re.IGNORECASE)


def test_readme_reference_is_generated_from_the_schema():
    text = README.read_text(encoding="utf-8")
    assert configdoc.current(text) == configdoc.reference(), (
        "README.md's settings reference is stale: run `python -m ktlong.configdoc --write`")


def test_reference_lists_every_key_and_profile():
    ref = configdoc.reference()
    for key, spec in config.FIELDS.items():
        row = next((line for line in ref.splitlines() if line.startswith(f"| `{key}` |")), None)
        assert row is not None, key
        assert configdoc._cell(spec.description) in row
    for name in config.available_profiles():
        assert f"| `{name}` |" in ref
    assert set(configdoc.DEFAULT_NOTES) <= set(config.FIELDS)


def test_splice_replaces_only_between_the_markers():
    text = f"before\n{configdoc.BEGIN}\nold\n{configdoc.END}\nafter\n"
    new = configdoc.splice(text, "new\n")
    assert new == f"before\n{configdoc.BEGIN}\nnew\n{configdoc.END}\nafter\n"
    assert configdoc.current(new) == "new\n"
    with pytest.raises(ValueError):
        configdoc.splice("no markers", "x")


def test_main_prints_the_reference(capsys):
    assert configdoc.main([]) == 0
    assert capsys.readouterr().out == configdoc.reference()
    assert configdoc.main(["--bogus"]) == 2


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_lab_notebook_wording(path):
    hits = [f"{path.name}:{i}: {line.strip()}"
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if NOTEBOOK.search(line)]
    assert not hits, "write results, not their history (git log keeps it):\n" + "\n".join(hits)


def test_notebook_pattern():
    for bad in ("Session 9: Q8 anchors", "runs 18-22", "in run 6", "sessions 3-7"):
        assert NOTEBOOK.search(bad), bad
    for fine in ("--decode-runs 5", "the engine's Session class", "median of 8 runs", "a run of 3"):
        assert not NOTEBOOK.search(fine), fine
