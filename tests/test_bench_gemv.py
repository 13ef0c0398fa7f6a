"""`ktlong bench gemv` at a small size: every type runs through the decode GEMV and its figures
are consistent; a bad type is one line, exit 2."""

from __future__ import annotations

import numpy as np
from typer.testing import CliRunner

from ktlong import quant
from ktlong.bench import gemv
from ktlong.cli import app


def test_gemv_bench_measures_every_type_against_the_bandwidth_probe(monkeypatch):
    monkeypatch.setattr(gemv, "SHAPES", ((64, 512), (32, 1024)))
    monkeypatch.setattr(gemv, "TARGET_BYTES", 1 << 20)
    rows = gemv.measure(list(gemv.TYPES), repeats=2)
    assert [r["type"] for r in rows] == list(gemv.TYPES)
    for r in rows:
        t = quant.TYPES[r["type"]]
        per_layer = t.tensor_bytes(64, 512) + t.tensor_bytes(32, 1024)
        assert r["weight_bytes"] == r["matrices"] // 2 * per_layer >= 1 << 20
        assert r["weight_gbps"] > 0 and r["stream_gbps"] > 0 and r["vs_bandwidth"] > 0
        assert np.isclose(r["weight_gbps"], r["weight_bytes"] / r["gemv_ms"] / 1e6)


def test_random_rows_decode_to_finite_values():
    rows = gemv._random_rows("Q4_K", 100, 512, np.random.default_rng(0))
    w = quant.dequantize_ref(rows, "Q4_K", 512)
    assert w.shape == (100, 512) and np.isfinite(w).all() and np.abs(w).max() > 0


def test_gemv_bench_refuses_an_unknown_type():
    r = CliRunner().invoke(app, ["bench", "gemv", "--types", "Q4_K,IQ2"])
    assert r.exit_code == 2 and "unknown weight type 'IQ2'" in r.output
    assert "Traceback" not in r.output
