"""`inspect model` (metadata only) and `inspect attention` (recall, overlap, the block map)."""
from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ktlong import attnmap
from ktlong.attnmap import INIT, LOCAL, LayerStats, analyse, block_mass, local_start
from ktlong.cli import app
from ktlong.config import resolve_settings
from ktlong.inspect import chat_prompt, map_rows, observe_attention, record_decode
from ktlong.model import load_model
from ktlong.spec import read_spec
from ktlong.tinymodel import filler_text

from .models import gguf_model, hf_model, settings

DOC = filler_text(1200, seed=5)  # ~1.4K tokens: 88 blocks of 16
QUESTION = "Which city is north of the river?"
TEST_KEYS = dict(kv_type="FP32", block_size=16, init_len=16, local_windows_len=64,
                 chunk_size=256, max_seq_len=8192, threads_num=2)
runner = CliRunner()


@pytest.fixture(scope="module")
def lm():
    return load_model(hf_model("llama", qk_scale=4.0), device="CPU", dtype="float32")


def _scale(lm) -> float:
    return float(lm.model.model.layers[0].self_attn.scaling)


# --- recall ----------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["dense profile", "budget covers every block"])
def test_recall_is_one_when_every_block_is_read(lm, how):
    st = (resolve_settings("dense", TEST_KEYS).settings if how == "dense profile"
          else settings(second_select_num=10_000))
    r = observe_attention(lm, st, DOC, QUESTION, n_answer=2)
    assert r.steps == 2 and len(r.layers) == 2
    for x in r.layers:
        assert x.dense and x.blocks_read == x.blocks_total
        assert x.recall == pytest.approx(1.0, abs=1e-6)
        assert x.recall_per_step == pytest.approx([1.0, 1.0], abs=1e-6)
        assert x.overlap == 1.0 and x.reuse_recall == pytest.approx(1.0, abs=1e-6)
    assert r.mean_recall == pytest.approx(1.0, abs=1e-6)
    assert "exact" in r.advice
    assert r.map.share.min() == 1.0  # every block read in every layer


def _exact_recall(q, k, blocks, n, bs, scale):
    """Token-level softmax in float64, head by head: share of the mass in `blocks`."""
    Hq, Hkv = q.shape[0], k.shape[0]
    out = []
    for h in range(Hq):
        s = (k[h // (Hq // Hkv), :n].astype(np.float64) @ q[h].astype(np.float64)) * scale
        p = np.exp(s - s.max())
        p /= p.sum()
        row = blocks[0] if blocks.shape[0] == 1 else blocks[h // (Hq // Hkv)]
        tokens = np.concatenate([np.arange(b * bs, min((b + 1) * bs, n)) for b in row])
        out.append(p[tokens].sum())
    return float(np.mean(out))


@pytest.mark.parametrize("mode", ["SHARED", "SEPARATE"])
def test_small_budget_recall_matches_numpy_and_the_kernel(lm, mode):
    from ktlong import kernels

    st = settings(second_select_num=4, head_select_mode=mode, anchor_type="MEAN")
    obs = record_decode(lm, st, DOC, QUESTION, n_answer=3)
    store = obs.session.store
    assert len(obs.records) == 3 * 2  # once per layer per observed token
    report = analyse(obs.records, store, st, _scale(lm), obs.n_doc)
    by_layer = {x.layer: x for x in report.layers}
    S = 1 if mode == "SHARED" else 2
    for i, rec in enumerate(obs.records):
        assert rec.blocks.shape[0] == S
        k = store.k_tail[rec.layer].reshape(2, -1, 16)  # FP32 store: [Hkv, tokens, d]
        want = _exact_recall(rec.q, k, rec.blocks, rec.n_tokens, 16, _scale(lm))
        # the kernel's log-sum-exp over the selected blocks vs over every block
        args = store.kernel_args(rec.layer)
        every = np.arange(-(-rec.n_tokens // 16), dtype=np.int32)[None]
        _, lse_sel = kernels.attend_blocks(rec.q, *args[:4], args[4], rec.blocks, rec.n_tokens,
                                           np.float32(_scale(lm)), 0)
        _, lse_all = kernels.attend_blocks(rec.q, *args[:4], args[4], every, rec.n_tokens,
                                           np.float32(_scale(lm)), 0)
        assert np.exp(lse_sel - lse_all).mean() == pytest.approx(want, abs=1e-4)
        got = by_layer[rec.layer].recall_per_step[i // 2]
        assert got == pytest.approx(want, abs=1e-5)
        assert 0.0 < got < 0.9  # 4 + 1 + 5 of ~90 blocks do not hold it all
    for x in report.layers:
        assert x.recall == pytest.approx(np.mean(x.recall_per_step))
        assert not x.dense and x.blocks_read < x.blocks_total
    assert report.mean_recall < 0.9
    assert "raise second_select_num (now 4" in report.advice


def test_block_mass_equals_softmax_per_block(monkeypatch):
    monkeypatch.setattr(attnmap, "TOKEN_CHUNK", 32)  # several chunks and a partial last block
    rng = np.random.default_rng(0)
    k = rng.standard_normal((2, 100, 8)).astype(np.float32)  # [Hkv, n, d]
    q = rng.standard_normal((3, 4, 8)).astype(np.float32) * 2  # [T, Hq, d]
    n = np.array([70, 99, 100])
    mass = block_mass(q, n, lambda a, b: k[:, a:b], 0.5, 16)  # [T, Hq, 7]
    for t in range(3):
        for h in range(4):
            s = k[h // 2, : n[t]] @ q[t, h] * 0.5
            p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
            want = np.bincount(np.arange(n[t]) // 16, weights=p, minlength=7)
            assert np.allclose(mass[t, h], want, atol=1e-6)


def test_overlap_and_reuse_with_token_step(lm):
    st = settings(second_select_num=4, token_step=2, anchor_type="MEAN")
    obs = record_decode(lm, st, DOC, QUESTION, n_answer=3)
    r = analyse(obs.records, obs.session.store, st, _scale(lm), obs.n_doc)
    for x in r.layers:
        recs = [rec for rec in obs.records if rec.layer == x.layer]
        jac = []
        for a, b in zip(recs, recs[1:], strict=False):
            n0 = local_start(b.n_tokens, st)  # blocks chosen beside init and the local window
            sa, sb = ({c for c in y.blocks[0].tolist() if 1 <= c < n0} for y in (a, b))
            jac.append(len(sa & sb) / len(sa | sb))
            if b.n_tokens % 2:  # token_step 2: this step reused the previous selection
                assert sa == sb
        assert x.overlap == pytest.approx(np.mean(jac))
        assert 0.0 <= x.reuse_recall <= 1.0


# --- the map ---------------------------------------------------------------------------------

def test_map_marks_init_local_and_selected_blocks(lm):
    st = settings(second_select_num=4, anchor_type="MEAN")
    obs = record_decode(lm, st, DOC, QUESTION, n_answer=2)
    r = analyse(obs.records, obs.session.store, st, _scale(lm), obs.n_doc)
    m = r.map
    first, last = obs.records[0].n_tokens, obs.records[-1].n_tokens
    nb, local0 = -(-last // 16), local_start(first, st)
    assert m.n_blocks == nb and m.doc_blocks == -(-obs.n_doc // 16)
    assert m.kind[0] == INIT and (m.kind[1:local0] == 0).all() and (m.kind[local0:] == LOCAL).all()
    for layer in (0, 1):
        recs = [x for x in obs.records if x.layer == layer]
        for rec in recs:  # every step read init and the local window
            row = set(rec.blocks[0].tolist())
            assert 0 in row and set(range(local_start(rec.n_tokens, st),
                                          -(-rec.n_tokens // 16))) <= row
        counts = np.zeros(nb)
        for rec in recs:
            counts[rec.blocks[0]] += 1
        assert np.allclose(m.share[layer], counts / len(recs))

    rows = [t.plain for t in map_rows(r, width=1000)]  # one column per block
    for layer, line in enumerate(rows):
        assert len(line) == nb and line[0] == "I" and set(line[local0:]) == {"L"}
        picked = {b for rec in obs.records if rec.layer == layer for b in rec.blocks[0].tolist()
                  if 1 <= b < local0}
        assert 1 <= len(picked) <= 8
        for b in range(1, local0):
            assert (line[b] in "░▒▓█") == (b in picked), (layer, b)
            if b in picked:  # read at both steps: full shade; at one: the half shade
                assert line[b] == ("█" if m.share[layer, b] == 1.0 else "▒")
    narrow = [t.plain for t in map_rows(r, width=20)]  # bucketed: ~4.6 blocks per column
    assert all(len(x) == 20 and x[0] == "I" and x[-1] == "L" for x in narrow)


# --- the CLI ---------------------------------------------------------------------------------

def _attention_args(tmp_path: Path, *extra: str) -> list[str]:
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    sets = [f"--set={k}={v}" for k, v in TEST_KEYS.items() if k != "kv_type"]
    return ["inspect", "attention", "--model", str(hf_model("llama", qk_scale=4.0)),
            "--prompt-file", str(doc), "--question", QUESTION, "--tokens", "2",
            "--kv-type", "FP32", "--set", "second_select_num=4", *sets, *extra]


def test_cli_attention_json_png_and_terminal(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "attn.png"
    r = runner.invoke(app, _attention_args(tmp_path, "--json", "--png", str(png)),
                      env={"COLUMNS": "120"})
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["steps"] == 2 and len(data["layers"]) == 2
    assert 0 < data["mean_recall"] < 0.9 and data["summary"].startswith("mean recall")
    assert data["settings"]["second_select_num"] == 4 and data["document_tokens"] > 1000
    assert data["map"]["kind"].startswith("I.") and data["map"]["kind"].endswith("L")
    share = data["map"]["share"]
    assert len(share) == 2 and len(share[0]) == data["map"]["n_blocks"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    r = runner.invoke(app, _attention_args(tmp_path), env={"COLUMNS": "100", "NO_COLOR": "1"})
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "recall" in out and "reuse recall" in out and "mean recall" in out
    assert "document tokens (from the prompt cache)" in out  # the first run stored it
    assert "raise second_select_num (now 4" in out
    map_lines = [x for x in out.splitlines() if x.startswith(("L0 ", "L1 "))]
    assert len(map_lines) == 2 and all(x[8] == "I" and x.rstrip()[-1] == "L" for x in map_lines)


def test_cli_attention_errors(tmp_path, monkeypatch):
    r = runner.invoke(app, ["inspect", "attention", "--prompt-file", str(tmp_path / "x.txt"),
                            "--question", "q"])
    assert r.exit_code == 2 and "needs a model" in r.output and "--model" in r.output
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed
    r = runner.invoke(app, _attention_args(tmp_path, "--png", str(tmp_path / "a.png")))
    assert r.exit_code == 2
    assert "--png needs matplotlib" in r.output and "pip install 'ktlong[plot]'" in r.output
    r = runner.invoke(app, [*_attention_args(tmp_path)[:4], "--prompt-file",
                            str(tmp_path / "none.txt"), "--question", "q"])
    assert r.exit_code == 2 and "prompt file" in r.output and "does not exist" in r.output


def test_prompt_is_the_chats_and_its_document_prefix_is_cached(lm, tmp_path):
    ids, n_doc = chat_prompt(lm.tokenizer, DOC, QUESTION)
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": DOC + "\n\n" + QUESTION}],
                                            add_generation_prompt=True, tokenize=False)
    assert lm.tokenizer.decode(ids) == text
    assert lm.tokenizer.decode(ids[:n_doc]) == text[:text.index(DOC) + len(DOC)] + "\n\n"
    st = settings(second_select_num=4)
    first = record_decode(lm, st, DOC, QUESTION, n_answer=2)
    again = record_decode(lm, st, DOC, "Another question?", n_answer=2)
    assert (first.source, again.source) == ("prefill", "cache")
    assert again.ids[:n_doc] == ids[:n_doc] and again.session.store.nb_base > 0
    r = analyse(again.records, again.session.store, st, _scale(lm), again.n_doc)  # mmap'd base
    assert 0 < r.mean_recall < 0.9


def test_advice_names_the_setting_to_change():
    from ktlong.attnmap import AttentionReport, BlockMap, advise

    def report(recalls, overlap=1.0):
        layers = [LayerStats(i, r, r, [r, r], overlap, r, 10, 100, False)
                  for i, r in enumerate(recalls)]
        bmap = BlockMap(16, 100, 90, np.zeros(100, np.int8), np.zeros((len(recalls), 100)))
        worst = int(np.argmin(recalls))
        return AttentionReport(layers, bmap, float(np.mean(recalls)), worst, 2)

    text = advise(report([0.5, 0.97, 0.98, 0.99, 0.99, 0.98, 0.97, 0.99]), settings())
    assert "worst layer 0 (50.0%)" in text and "set dense_layer_num to 1" in text
    assert "keeps the attention" in advise(report([0.99] * 4), settings())
    text = advise(report([0.6] * 4, overlap=0.3), settings(token_step=4, preselect_block=True))
    assert "misses much" in text and "lower token_step (now 4)" in text
    assert "preselect_block_count" in text and "raise second_select_num (now 8, try 16)" in text


# --- inspect model ---------------------------------------------------------------------------

def _no_weight_loading(monkeypatch):
    """Every way ktlong could read tensor data raises."""
    import safetensors
    import safetensors.numpy
    import safetensors.torch
    import torch
    import transformers

    def boom(*a, **k):
        raise AssertionError("weights were loaded")

    for mod, name in ((safetensors, "safe_open"), (safetensors.numpy, "load_file"),
                      (safetensors.torch, "load_file"), (torch, "load"),
                      (transformers.AutoModelForCausalLM, "from_pretrained"),
                      (transformers.PreTrainedModel, "from_pretrained")):
        monkeypatch.setattr(mod, name, boom)
    import gguf

    monkeypatch.setattr(gguf.quants, "dequantize", boom)


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_inspect_model_json_without_loading_weights(fmt, lm, monkeypatch):
    path = hf_model("llama", qk_scale=4.0) if fmt == "hf" else gguf_model("llama", "Q8_0")
    _no_weight_loading(monkeypatch)
    r = runner.invoke(app, ["inspect", "model", str(path), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert (d["format"], d["arch"], d["n_layers"], d["n_heads"], d["n_kv_heads"],
            d["head_dim"]) == (fmt, "llama", 2, 4, 2, 16)
    assert d["rope"] == {"type": "default", "theta": 10000.0, "scaling": None}
    assert d["max_positions"] == 131072 and d["has_chat_template"] is True
    assert d["kv_type"] == "BF16" and d["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2
    assert d["n_params"] == sum(p.numel() for p in lm.model.parameters())
    if fmt == "hf":
        assert d["weight_types"] == {"F32": 21}
    else:
        assert d["weight_types"] == {"Q8_0": 16, "F32": 5}  # 2-D weights quantised, norms not
    r = runner.invoke(app, ["inspect", "model", str(path), "--kv-type", "FP32"],
                      env={"COLUMNS": "120", "NO_COLOR": "1"})
    assert r.exit_code == 0, r.output
    for text in ("architecture", "llama", "4 query, 2 KV (GQA, 2 per KV head)",
                 "default, base 10000", "131,072", "512 bytes (FP32)", "chat template  yes"):
        assert text in r.stdout, text


def test_inspect_model_imports_no_torch():
    code = ("import sys\nfrom ktlong.cli import main\ntry:\n    main(sys.argv[1:])\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "print('HEAVY', [m for m in ('torch', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code, "inspect", "model", "--json",
                          str(gguf_model("llama", "Q8_0"))],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("HEAVY []")


def _io() -> tuple[int, int]:
    """(bytes read through read() calls, minor page faults) of this process so far."""
    rchar = next(int(x.split()[1]) for x in open("/proc/self/io") if x.startswith("rchar"))
    return rchar, resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_spec_of_a_1gb_model_reads_only_headers(fmt, tmp_path):
    """A 1 GiB tensor (a sparse file): reading the spec reads kilobytes and maps no data pages."""
    gib = 1 << 30
    if fmt == "hf":
        (tmp_path / "config.json").write_text(json.dumps(
            {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "hidden_size": 64, "vocab_size": gib // 256}))
        header = json.dumps({"model.embed_tokens.weight": {
            "dtype": "F32", "shape": [gib // 256, 64], "data_offsets": [0, gib]}}).encode()
        path = tmp_path / "model.safetensors"
        path.write_bytes(struct.pack("<Q", len(header)) + header)
        os.truncate(path, 8 + len(header) + gib)
        target = tmp_path
    else:
        import gguf

        path = target = tmp_path / "model.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_block_count(2)
        w.add_embedding_length(64)
        w.add_head_count(4)
        w.add_head_count_kv(2)
        w.add_tensor_info("token_embd.weight", (gib // 256, 64), np.dtype(np.float32), gib)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.close()
        os.truncate(path, -(-path.stat().st_size // 32) * 32 + gib)
    read_spec(target)  # warm imports and caches
    r0, f0 = _io()
    spec = read_spec(target)
    r1, f1 = _io()
    assert spec.weights_bytes == gib and spec.n_params == gib // 4
    assert r1 - r0 < 1 << 20, f"read {r1 - r0} bytes"  # header + fingerprint samples only
    assert f1 - f0 < 200, f"{f1 - f0} page faults"  # a full read would fault thousands of times
