"""`ktlong bench decode` at tiny contexts: the JSON it prints has the documented shape."""
from __future__ import annotations

import json

import pytest

from ktlong.bench import decode


def test_bench_decode_json(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    monkeypatch.setattr(decode, "BANDWIDTH_BYTES", 8 << 20)
    monkeypatch.setattr(decode, "FLUSH_BYTES", 1 << 20)
    decode.main(contexts=[20000, 1000], repeats=1, threads=1, as_json=True)
    data = json.loads(capsys.readouterr().out)
    assert data["bandwidth_gbps"] > 0
    rows = data["rows"]
    assert [r["context"] for r in rows] == [1000, 20000]
    for r in rows:
        for key in ("sparse_ms", "dense_ms", "kv_read_gbps"):
            assert isinstance(r[key], float) and r[key] > 0
        assert r["dense_path"] in r["dense_paths_ms"]
    # 1000 tokens fit the budget (every block); at 20000: the init block, 96 chosen blocks and the
    # local window's blocks, from block (20000 - 4096) // 128 = 124 on (4128 tokens)
    assert rows[0]["attended_tokens"] == 1000
    assert rows[1]["attended_tokens"] == 128 + 96 * 128 + (20000 - 124 * 128)
    assert rows[0]["vs_first"] == 1.0 and rows[1]["vs_first"] > 0
    assert all(0 < r["kv_vs_bandwidth"] for r in rows)


def test_rounds_interleave_contexts():
    """Each round runs every (context, path) once, after a flush, so the ratios taken within a
    round compare runs made a moment apart."""
    calls: list[str] = []
    fns = {(n, p): (lambda n=n, p=p: calls.append(f"{n}{p}")) for n in (1, 2) for p in "ab"}
    times = decode._rounds(fns, lambda: calls.append("flush"), repeats=2)
    one_round = ["flush", "1a", "flush", "1b", "flush", "2a", "flush", "2b"]
    assert calls == ["1a", "1b", "2a", "2b"] + one_round * 2  # warm-up, then the rounds
    assert all(len(t) == 2 for t in times.values())


def test_bench_decode_quest_reads_two_anchors(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]):
    """--quest scores blocks by Quest's bound: the same attended tokens, twice the anchor bytes
    (Q8: 128 codes and a 4-byte scale per KV head)."""
    monkeypatch.setattr(decode, "BANDWIDTH_BYTES", 8 << 20)
    monkeypatch.setattr(decode, "FLUSH_BYTES", 1 << 20)
    got = {}
    for quest in (False, True):
        decode.main(contexts=[20000], repeats=1, threads=1, as_json=True, quest=quest)
        data = json.loads(capsys.readouterr().out)
        assert data["anchors"] == ("quest" if quest else "one")
        got[quest] = data["rows"][0]
    assert got[True]["attended_tokens"] == got[False]["attended_tokens"]
    candidates = (20000 - 4096) // 128 - 1  # between the init block and the local window
    assert got[True]["kv_read_bytes"] - got[False]["kv_read_bytes"] == candidates * 8 * (128 + 4)
    assert all(r["sparse_bf16_anchors_ms"] > 0 for r in got.values())


def test_bench_decode_table_fits_80_columns(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]):
    """The table's every figure is printed whole in an 80-column terminal (rich cuts a cell that
    does not fit to '…')."""
    monkeypatch.setattr(decode, "BANDWIDTH_BYTES", 8 << 20)
    monkeypatch.setattr(decode, "FLUSH_BYTES", 1 << 20)
    monkeypatch.setenv("COLUMNS", "80")
    decode.main(contexts=[20000, 1000], repeats=1, threads=1, as_json=False)
    out = capsys.readouterr().out
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "20,000" in out and "1,000" in out and "KV" in out
