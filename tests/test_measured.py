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


def test_quoted_figures_are_the_recorded_runs() -> None:
    assert MEASURED
    for m in MEASURED.values():
        recorded: dict[tuple[str, int], tuple[int, int, set[int]]] = {}
        for name in m.results:
            run = json.loads((RESULTS / name).read_text())
            assert run["haystack"] == m.haystack
            seed = re.search(r"--seed (\d+)", run["command"])
            seed = int(seed.group(1)) if seed else 0
            for c in run["summary"]:
                if c["profile"] != m.profile:
                    continue
                key, (r, n, seeds) = (c["task"], c["length"]), (c["right"], c["n"], {seed})
                old = recorded.get(key)
                if old is not None and seed not in old[2]:  # more documents of the same cell
                    r, n, seeds = r + old[0], n + old[1], old[2] | seeds
                recorded[key] = (r, n, seeds)  # else a later run's cell replaces an earlier's
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
