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


def _run_answers(run: dict, profile: str) -> list[tuple[str, int, tuple, bool]]:
    """(task, length, document, right) of each answer of `profile` in one saved run. A document
    is (seed, samples, index): a run that stopped early holds its first ones, one of `--only`
    those, in the order its records (document by document) list them."""
    if "summary" in run:  # a `bench accuracy` result
        cmd = run["command"]
        seed, samples = int(_flag(cmd, "seed", "0")), int(_flag(cmd, "samples", "0"))
        only = [int(i) for i in _flag(cmd, "only", "").split(",") if i] or list(range(samples))
        seen: dict[tuple[str, int], int] = {}
        out = []
        for r in run["records"]:
            if Path(r["profile"]).name == profile:
                k = seen[r["task"], r["length"]] = seen.get((r["task"], r["length"]), -1) + 1
                out.append((r["task"], r["length"], (seed, samples, only[k]), r["correct"]))
        return out
    # a re-read of chosen documents, one record per (document, settings, task)
    what = run["what"]
    seed, samples = (int(re.search(rf"--{k} (\d+)", what)[1]) for k in ("seed", "samples"))
    length = int(re.search(r"(\d+)K tokens", what)[1]) * 1024
    return [(r["task"], length, (seed, samples, r["document"]), r["correct"])
            for r in run["records"] if r["settings"] == profile]


def test_quoted_figures_are_the_recorded_runs() -> None:
    """Each cell sums its documents' answers; a later run of a document replaces its answers."""
    assert MEASURED
    for m in MEASURED.values():
        recorded: dict[tuple[str, int], dict[tuple, bool]] = {}
        for name, profile in m.results:
            run = json.loads((RESULTS / name).read_text())
            assert run.get("haystack", m.haystack) == m.haystack
            answers = _run_answers(run, profile)
            assert answers, f"{name} has no answers of {profile}"
            for task, length, doc, right in answers:
                recorded.setdefault((task, length), {})[doc] = right
        assert {(t, n): (r, a) for t, n, r, a in m.cells} == {
            k: (sum(docs.values()), len(docs)) for k, docs in recorded.items()}


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
