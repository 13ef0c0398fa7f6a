"""`ktlong bench decode` at tiny contexts: the JSON it prints has the documented shape."""
from __future__ import annotations

import json

import numpy as np
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


ROW_BYTES = {"BF16": 256, "Q8_0": 136, "Q4_0": 72}  # one stored row of 128 channels


def test_bench_decode_kv_types(monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]):
    """--kv-type BF16,Q8_0,Q4_0: a row per kv_type and context, timed in the same rounds; the KV
    bytes a step reads are in the ratio of the formats' row bytes (the anchors' bytes aside);
    torch's dense paths only for BF16; vs_first_type against the first kv_type."""
    monkeypatch.setattr(decode, "BANDWIDTH_BYTES", 8 << 20)
    monkeypatch.setattr(decode, "FLUSH_BYTES", 1 << 20)
    types = ["BF16", "Q8_0", "Q4_0"]
    decode.main(contexts=[20000, 1000], repeats=1, threads=1, as_json=True, kv_types=types)
    data = json.loads(capsys.readouterr().out)
    assert data["kv_types"] == types
    rows = data["rows"]
    assert [(r["context"], r["kv_type"]) for r in rows] == [(n, t) for n in (1000, 20000)
                                                            for t in types]
    anchor_bytes = {1000: 0, 20000: ((20000 - 4096) // 128 - 1) * 8 * (128 + 4)}
    for r in rows:
        n, t = r["context"], r["kv_type"]
        assert r["kv_row_bytes"] == ROW_BYTES[t]
        assert r["attended_tokens"] == (1000 if n == 1000 else 128 + 96 * 128 + (20000 - 124 * 128))
        assert r["kv_read_bytes"] == 2 * r["attended_tokens"] * 8 * ROW_BYTES[t] + anchor_bytes[n]
        for key in ("sparse_ms", "dense_ms", "kv_read_gbps", "vs_first_type", "vs_first"):
            assert isinstance(r[key], float) and r[key] > 0
        assert r["kv_read_gbps"] == pytest.approx(r["kv_read_bytes"] / r["sparse_ms"] / 1e6)
        if t == "BF16":
            assert r["vs_first_type"] == 1.0
            assert set(r["dense_paths_ms"]) == {"kernel", "torch_matmul", "torch_sdpa"}
            assert r["speedup_vs_torch"] > 0
        else:
            assert r["dense_paths_ms"] == {"kernel": r["dense_ms"]} and r["dense_path"] == "kernel"
            assert r["speedup_vs_torch"] is None
    by = {(r["context"], r["kv_type"]): r for r in rows}
    for n in (1000, 20000):  # 256 : 136 : 72 bytes a row, at the context the budget covers exactly
        kv = {t: by[n, t]["kv_read_bytes"] - anchor_bytes[n] for t in types}
        assert kv["BF16"] * 136 == kv["Q8_0"] * 256 and kv["BF16"] * 72 == kv["Q4_0"] * 256
    assert by[1000, "Q4_0"]["kv_read_bytes"] * 256 == by[1000, "BF16"]["kv_read_bytes"] * 72


def test_random_rows_are_valid_quantised_rows():
    """The synthetic Q8_0 / Q4_0 rows (shared with --shape's store fill): random codes, every
    block's float16 scale the fixed one, so every value is within +-2 and not all alike."""
    import numpy as np
    from ktlong.kernels import kvquant

    for kind, scale in ((3, 1 / 64), (4, 1 / 4)):
        raw = np.empty((2, 64, kvquant.row_bytes(kind, 128)), np.uint8)
        assert decode.random_rows(raw, kind, 128, seed=5) is raw
        nc = kvquant.code_bytes(kind, 128)
        assert (raw[..., nc:nc + 8].copy().view(np.float16) == np.float16(scale)).all()
        x = kvquant.decode_ref(raw, kind, 128)
        assert np.abs(x).max() <= 2 and len(np.unique(x)) > 8
    bf16 = np.empty((2, 64, 256), np.uint8)
    decode.random_rows(bf16, 1, 128, seed=5)
    words = np.empty(2 * 64 * 128 // 2, np.uint32)
    decode._fill(words, 5)  # BF16: exactly today's fill
    assert (bf16.reshape(-1).view(np.uint32) == words).all()


def test_bench_decode_kv_types_table_fits_80_columns(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]):
    """A row per context and kv_type, every figure whole in 80 columns at the widest values a
    1M-token run gives; torch's speed-up only on BF16 rows."""
    monkeypatch.setenv("COLUMNS", "80")
    rows = [dict(context=n, kv_type=t, sparse_ms=12.34, select_ms=3.21,
                 sparse_bf16_anchors_ms=13.45, dense_ms=1234.5,
                 speedup_vs_torch=123.4 if t == "BF16" else None, kv_read_gbps=123.4,
                 kv_vs_bandwidth=0.85, vs_first=12.34, vs_first_type=1.0 if t == "Q8_0" else 0.87)
            for n in (16384, 1048576) for t in ("Q8_0", "BF16")]
    decode.print_table({"threads": 64, "repeats": 5, "anchors": "quest", "bandwidth_gbps": 250.0,
                        "kv_types": ["Q8_0", "BF16"], "rows": rows})
    out = capsys.readouterr().out
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) <= 80
    cells = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [c[:2] for c in cells] == [[f"{n:,}", t] for n in (16384, 1048576)
                                      for t in ("Q8_0", "BF16")]
    assert [c[-1] for c in cells[:2]] == ["1.00x", "0.87x"]
    assert "123.4x" in cells[1] and not any(c.endswith("x") for c in cells[0][2:-1])
    assert "time at 1,048,576 / time at 16,384" in out and "Q8_0 12.34x, BF16 12.34x" in out


def test_bench_decode_unknown_kv_type_is_one_line():
    from typer.testing import CliRunner

    from ktlong.cli import app

    r = CliRunner().invoke(app, ["bench", "decode", "--contexts", "1000", "--kv-type",
                                 "BF16,Q5_0"])
    assert r.exit_code == 2
    assert r.output.count("\n") == 1 and "Q5_0" in r.output and "Q4_0" in r.output


def test_bench_decode_unknown_peer_is_one_line():
    from typer.testing import CliRunner

    from ktlong.cli import app

    r = CliRunner().invoke(app, ["bench", "decode", "--shape", "8b", "--contexts", "1000",
                                 "--peers", "llamacpp-fa,ollama"])
    assert r.exit_code == 2
    assert r.output.count("\n") <= 2 and "ollama" in r.output and "llamacpp-nofa" in r.output


def test_decodemodel_worker_q4_0_on_disk(tmp_path):
    """The --shape worker, tiny: a head_dim-32 model (Q4_0 needs d % 32 == 0) decodes over a
    synthetic Q4_0 KV of ~600 tokens in the disk tier; the tier's file is gone afterwards."""
    from ktlong.kernels import kvquant

    from ktlong.bench import decodemodel
    from ktlong.tinymodel import write_gguf

    from .models import hf_model

    folder = hf_model("llama", head_dim=32)  # 2 layers, 2 KV heads
    gguf = write_gguf(folder, tmp_path / "m.gguf", "F32")
    context, steps = 600, 3
    r = decodemodel.worker(str(gguf), "Q4_0", "disk", context, steps, 1, 1, str(tmp_path))
    assert r["kv_type"] == "Q4_0" and r["kv_tier"] == "disk" and r["layers"] == 2
    assert r["tok_s"] > 0 and len(r["runs_tok_s"]) == 1
    per_token = 2 * 2 * 2 * kvquant.row_bytes(4, 32)  # layers, KV heads, K and V, 20-byte rows
    assert r["kv_bytes"] % per_token == 0
    assert context < r["kv_bytes"] // per_token <= context + decodemodel.QUESTION + steps
    assert (tmp_path / "tier").is_dir()  # the disk tier was made there ...
    assert list((tmp_path / "tier").iterdir()) == []  # ... and its file unlinked
    assert r["rss_anon_gb"] > 0


def test_decodemodel_worker_on_a_sliding_window_model(tmp_path):
    """--model with a Gemma 3: the store holds the full layers' synthetic rows, the sliding
    layers' ring a window of random rows; the decode reads both."""
    from ktlong.bench import decodemodel
    from ktlong.tinymodel import make_model

    path = make_model(tmp_path / "gemma", "gemma3_text", layers=6, hidden=64, heads=4,
                      kv_heads=1, head_dim=16, sliding_window=16, seed=3)
    context, steps = 300, 3
    r = decodemodel.worker(str(path), "BF16", "ram", context, steps, 2, 1, str(tmp_path))
    assert r["layers"] == 6 and r["tok_s"] > 0 and len(r["runs_tok_s"]) == 2  # runs restart
    per_token = 1 * 2 * 1 * 16 * 2  # one full layer (of 6; Gemma 3's pattern), K and V, bf16
    assert context * per_token < r["kv_bytes"] <= (context + 64 + steps) * per_token


def test_bench_decode_plot_has_a_line_per_kv_type(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [dict(context=n, kv_type=t, sparse_ms=s * f, dense_ms=d * f)
            for n, s, d in ((16384, 0.9, 1.3), (1 << 20, 1.3, 84.0))
            for t, f in (("BF16", 1.0), ("Q4_0", 0.5))]
    data = {"bench": "decode", "command": "ktlong bench decode --kv-type BF16,Q4_0",
            "machine": "Test CPU, 2 cores", "threads": 2, "model": decode.MODEL, "repeats": 1,
            "bandwidth_gbps": 20.0, "anchors": "one", "kv_types": ["BF16", "Q4_0"], "rows": rows}
    fig = decode.plot(data, tmp_path / "d.png")
    lines = {line.get_label(): list(line.get_ydata()) for line in fig.axes[0].get_lines()}
    assert lines == {"sparse step, BF16 KV (1 anchor per block)": [0.9, 1.3],
                     "sparse step, Q4_0 KV (1 anchor per block)": [0.45, 0.65],
                     "dense (fastest exact path, BF16 KV)": [1.3, 84.0]}
    assert "BF16, Q4_0 KV" in fig._suptitle.get_text()


def test_decodemodel_worker_runs_a_profile_with_the_questions_blocks(tmp_path):
    """--profiles: the worker decodes under a YAML profile; the question re-fed before each run
    takes its votes (question_s), and the steps read the pinned blocks."""
    from ktlong.bench import decodemodel
    from ktlong.tinymodel import write_gguf

    from .models import hf_model

    gguf = write_gguf(hf_model("llama", head_dim=32), tmp_path / "m.gguf", "F32")
    prof = tmp_path / "pins.yaml"
    prof.write_text("block_size: 16\ninit_len: 16\nlocal_windows_len: 64\n"
                    "second_select_num: 8\nquestion_blocks: 2\nkv_type: FP32\n")
    r = decodemodel.worker(str(gguf), "BF16", "ram", 800, 3, 1, 1, str(tmp_path), str(prof))
    assert r["profile"] == str(prof) and r["tok_s"] > 0 and r["question_s"] > 0
    assert r["pinned"] == 2


@pytest.mark.parametrize("ggml_type", [1, 8])
def test_llama_state_layout(ggml_type):
    """The synthetic llama.cpp sequence state, read back field by field as llama.cpp's
    state_read does: header, one cell per token at positions 0..n-1, then per layer the K rows
    and per layer the V rows, each behind its type and row size; values finite and bounded."""
    import struct

    from ktlong.bench import llamastate

    n, layers, dim = 37, 3, 64
    b = llamastate.seq_state(n, layers, dim, ggml_type, seed=1, seq_id=0).tobytes()
    assert len(b) == llamastate.state_size(n, layers, dim, ggml_type)
    assert struct.unpack_from("<IiII", b, 0) == (0xAF143CD8, 0, 1, n)
    cells = [struct.unpack_from("<iIi", b, 16 + 12 * i) for i in range(n)]
    assert cells == [(i, 1, 0) for i in range(n)]
    off = 16 + 12 * n
    assert struct.unpack_from("<II", b, off) == (0, layers)  # rows, not transposed
    off += 8
    rb = 2 * dim if ggml_type == 1 else dim // 32 * 34
    for _ in range(2 * layers):
        assert struct.unpack_from("<iQ", b, off) == (ggml_type, rb)
        rows = np.frombuffer(b, np.uint8, n * rb, off + 12).reshape(n, rb)
        if ggml_type == 1:
            vals = rows.view(np.float16).astype(np.float32)
        else:
            blocks = rows.reshape(n, dim // 32, 34)
            scale = blocks[:, :, :2].copy().view(np.float16).astype(np.float32)
            vals = blocks[:, :, 2:].view(np.int8) * scale
        assert np.isfinite(vals).all() and np.abs(vals).max() <= 8 and vals.std() > 0.3
        off += 12 + n * rb
    assert off == len(b)
    with pytest.raises(ValueError, match="Q8_0 needs"):
        llamastate.row_bytes(8, 40)
    with pytest.raises(ValueError, match="only F16"):
        llamastate.row_bytes(2, 64)


def test_llama_state_transposed_values():
    """Without flash attention llama.cpp keeps V transposed: each layer's V is announced by its
    element size and width, not a row size; the total size is the same."""
    import struct

    from ktlong.bench import llamastate

    n, layers, dim = 5, 2, 64
    b = llamastate.seq_state(n, layers, dim, 1, v_trans=True).tobytes()
    assert len(b) == llamastate.state_size(n, layers, dim, 1)
    off = 16 + 12 * n
    assert struct.unpack_from("<II", b, off) == (1, layers)
    off += 8 + layers * (12 + n * 2 * dim)  # past the keys
    for _ in range(layers):
        assert struct.unpack_from("<iII", b, off) == (1, 2, dim)
        off += 12 + n * 2 * dim
    assert off == len(b)
    with pytest.raises(ValueError, match="F16 only"):
        llamastate.seq_state(n, layers, dim, 8, v_trans=True)


def test_llama_state_of_a_sliding_window_model():
    """Gemma 3's iSWA cache (the layout llama.cpp 0.3.36 wrote for a 600-token Gemma 3 270M
    prompt): the full layers' cache of every position, then the sliding layers' cache of the
    last `swa_window` positions, each with its own stream, cells and layer count."""
    import struct

    from ktlong.bench import llamastate

    n, full, swa, window, dim = 60, 2, 5, 16, 64
    b = llamastate.seq_state(n, full, dim, 1, swa_layers=swa, swa_window=window).tobytes()
    assert len(b) == llamastate.state_size(n, full, dim, 1, swa, window)
    assert struct.unpack_from("<Ii", b, 0) == (0xAF143CD8, 0)
    off, rb = 8, 2 * dim
    for layers, first in ((full, 0), (swa, n - window)):
        cells = n - first
        assert struct.unpack_from("<II", b, off) == (1, cells)
        off += 8
        assert [struct.unpack_from("<i", b, off + 12 * i)[0] for i in range(cells)] == \
            list(range(first, n))
        off += 12 * cells
        assert struct.unpack_from("<II", b, off) == (0, layers)
        off += 8
        for _ in range(2 * layers):
            assert struct.unpack_from("<iQ", b, off) == (1, rb)
            off += 12 + cells * rb
    assert off == len(b)
    short = llamastate.seq_state(10, full, dim, 1, swa_layers=swa, swa_window=window)
    assert short.size == llamastate.state_size(10, full, dim, 1, swa, window)  # all in the window


def test_prose_worker_decodes_a_chat_over_real_prose(tmp_path):
    """-m's default: real prose behind the chat template, read by ktlong's prefill the first
    time and mapped from the prompt cache the next, as a user's second chat on it is."""
    from ktlong.bench import decodemodel
    from ktlong.tinymodel import write_gguf

    from .models import hf_model

    gguf = write_gguf(hf_model("llama"), tmp_path / "m.gguf", "F32")
    doc = tmp_path / "doc.txt"
    doc.write_text("The Python Software Foundation License applies to this text. " * 60)
    first = decodemodel.prose_worker(str(gguf), "BF16", 0, 4, 2, 1, str(tmp_path), "default",
                                     str(doc))
    again = decodemodel.prose_worker(str(gguf), "BF16", 0, 4, 2, 1, str(tmp_path), "default",
                                     str(doc))
    assert first["kv_source"] == again["kv_source"] == "prose"
    assert (first["opened_from"], again["opened_from"]) == ("prefill", "cache")
    assert first["context"] == again["context"] > 300  # the whole file, as the chat reads it
    assert first["tok_s"] > 0 and again["tok_s"] > 0 and len(again["runs_tok_s"]) == 2
    row = decodemodel.prose_worker(str(gguf), "BF16", 500, 3, 1, 1, str(tmp_path))
    assert 450 <= row["context"] <= 560  # prose cut to 500 tokens, plus the template
