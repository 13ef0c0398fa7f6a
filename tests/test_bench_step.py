"""`ktlong bench step` on a tiny GGUF model: its parts add up to the token's time, and the byte
limit counts the weights a step reads."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from typer.testing import CliRunner

from ktlong.cli import app
from ktlong.tinymodel import make_model, write_gguf


def test_step_parts_add_up_and_the_limit_counts_every_weight(tmp_path: Path) -> None:
    path = write_gguf(make_model(tmp_path / "hf", "llama"), tmp_path / "m.gguf", "Q8_0")
    r = CliRunner().invoke(app, ["bench", "step", "-m", str(path), "--context", "300",
                                 "--steps", "8", "--runs", "2", "-t", "1", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout.strip().splitlines()[-1])
    parts = data["parts_ms"]
    assert list(parts) == ["attention GEMVs", "MLP GEMVs", "attention", "output head",
                           "norms, RoPE, rest", "outside the step"]
    assert all(v >= 0 for v in parts.values()) and min(list(parts.values())[:4]) > 0
    assert sum(parts.values()) == pytest.approx(data["token_ms"], rel=0.05)
    assert data["tok_s"] == pytest.approx(1e3 / data["token_ms"])
    tensors = gguf.GGUFReader(str(path)).tensors
    linear = sum(int(t.n_bytes) for t in tensors if t.name.startswith("blk.")
                 and len(t.shape) == 2)
    head = [t for t in tensors if t.name == "output.weight"] or \
        [t for t in tensors if t.name == "token_embd.weight"]
    assert data["weight_bytes"] == linear + int(head[0].n_bytes)
    assert 0 < data["kv_bytes"] and 0 < data["of_limit"]
    assert data["limit_ms"] == pytest.approx(
        (data["weight_bytes"] + data["kv_bytes"]) / data["stream_gbps"] / 1e6, rel=1e-3)
    text = CliRunner().invoke(app, ["bench", "step", "-m", str(path), "--context", "300",
                                    "--steps", "8", "--runs", "1", "-t", "1"])
    assert text.exit_code == 0 and "byte limit" in text.stdout
