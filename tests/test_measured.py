"""The answers memcheck quotes are those the runs in docs/results/ recorded, for the right model."""
from __future__ import annotations

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from ktlong.cli import app
from ktlong.measured import MEASURED, for_spec
from ktlong.registry import resolve_model
from ktlong.spec import read_spec

from .models import gguf_model

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def _flag(command: str, name: str, default: str) -> str:
    m = re.search(rf"--{name} (\S+)", command)
    return m.group(1) if m else default


def _run_cells(run: dict, profile: str) -> list[tuple[str, int, int, int, set]]:
    """(task, length, right, asked, documents) of `profile` in one saved run. Documents are
    (seed, index) pairs: a run that stopped early holds its first ones, one of `--only` those."""
    if "summary" in run:  # a `bench accuracy` result
        cmd = run["command"]
        seed, samples = int(_flag(cmd, "seed", "0")), int(_flag(cmd, "samples", "0"))
        only = [int(i) for i in _flag(cmd, "only", "").split(",") if i] or range(samples)
        return [(c["task"], c["length"], c["right"], c["n"],
                 {(seed, i) for i in list(only)[:c["n"]]})
                for c in run["summary"] if Path(c["profile"]).name == profile]
    # a re-read of chosen documents, one record per (document, settings, task)
    what = run["what"]
    seed, length = int(_flag(what, "seed", "0")), int(re.search(r"(\d+)K tokens", what)[1]) * 1024
    out: dict[str, list] = {}
    for r in run["records"]:
        if r["settings"] == profile:
            cell = out.setdefault(r["task"], [0, 0, set()])
            cell[0], cell[1] = cell[0] + r["correct"], cell[1] + 1
            cell[2].add((seed, r["document"]))
    return [(t, length, r, n, docs) for t, (r, n, docs) in out.items()]


def test_quoted_figures_are_the_recorded_runs() -> None:
    assert MEASURED
    for m in MEASURED.values():
        recorded: dict[tuple[str, int], tuple[int, int, set]] = {}
        for name, profile in m.results:
            run = json.loads((RESULTS / name).read_text())
            assert run.get("haystack", m.haystack) == m.haystack
            cells = _run_cells(run, profile)
            assert cells, f"{name} has no answers of {profile}"
            for task, length, r, n, docs in cells:
                old = recorded.get((task, length))
                if old is not None and not docs & old[2]:  # more documents of the same cell
                    r, n, docs = r + old[0], n + old[1], old[2] | docs
                recorded[task, length] = (r, n, docs)  # else a later run replaces an earlier's
        assert {(t, n): (r, a) for t, n, r, a in m.cells} == {
            k: (r, n) for k, (r, n, _) in recorded.items()}


def test_a_known_model_is_found_by_its_fingerprint_and_memcheck_quotes_it() -> None:
    spec = read_spec(resolve_model("smollm2"), need_weights=False)
    m = for_spec(spec)
    assert m is not None and "SmolLM2" in m.model
    r = CliRunner().invoke(app, ["memcheck", "-m", "smollm2", "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)["measured"]
    assert got["line"] == m.line() and len(got["cells"]) == len(m.cells)
    r = CliRunner().invoke(app, ["memcheck", "-m", "smollm2"])
    assert r.exit_code == 0 and "measured answers of this model" in r.output
    first = m.cells[0]
    assert f"{first[2]}/{first[3]} at" in m.line()


def test_an_unmeasured_model_gets_no_figures() -> None:
    path = gguf_model("llama")
    assert for_spec(read_spec(path, need_weights=False)) is None
    r = CliRunner().invoke(app, ["memcheck", "-m", str(path), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["measured"] is None
    assert for_spec(object()) is None
