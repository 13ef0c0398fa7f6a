"""`bench prefill`'s worker on a tiny model, whole and sampled: the sampled estimate times only
the picked chunks (over a store filled with random K, V up to each) and scales them; the
arithmetic limit it is held against (the dot-product instructions' measured peak) and the
projected time of a 128K read."""

from __future__ import annotations

import pytest

from ktlong.bench import prefill

from .models import hf_model


@pytest.mark.parametrize("mode", ["dense", "window", "minference"])
def test_sampled_prefill_fills_the_past_and_scales_the_chunks(mode):
    model = hf_model("llama")
    whole = prefill._worker(f"ktlong-{mode}", str(model), 2048, 1, 512, 0)
    sampled = prefill._worker(f"ktlong-{mode}", str(model), 2048, 1, 512, 2)
    for row in (whole, sampled):
        assert row["prefill"] == mode and row["context"] == 2048
        assert row["prefill_s"] > 0 and row["prefill_tok_s"] == pytest.approx(
            2048 / row["prefill_s"])
        assert 0 < row["attention_s"] <= row["prefill_s"]
        # the tiny llama's decoder layers: 2 x (q, k, v, o, gate, up, down weights) a token
        assert row["matmul"] == "FP32" and row["linear_ops"] == _linear_ops(model)
    assert sampled["sampled_chunks"] == 2 and whole["sampled_chunks"] == 0
    # two of four chunks timed, times two: the same order of time as the whole prefill
    assert 0.2 < sampled["prefill_s"] / whole["prefill_s"] < 5


def _linear_ops(folder) -> int:
    import json

    c = json.loads((folder / "config.json").read_text())
    h, d = c["hidden_size"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    per = h * q + 2 * h * kv + q * h + 3 * h * c["intermediate_size"]
    return 2 * per * c["num_hidden_layers"]


def test_peaks_measure_each_instruction_the_cpu_has():
    from ktlong.kernels import qmatmul

    got = prefill.peaks(1)
    assert set(got) == set(qmatmul.peak_kinds())
    for kind, ops in got.items():
        assert 1e9 < ops < 1e14, kind  # between 1 GOP/s and 100 TOP/s on one thread


def test_the_limit_and_the_128k_projection_follow_the_run():
    peak = {"vnni": 300e9, "amx-int8": 2000e9, "amx-bf16": 1000e9}
    row = dict(context=4096, prefill_s=10.0, attention_s=2.0, prefill="dense", matmul="INT8",
               linear_ops=1e9)
    prefill.against_limit(row, peak)
    assert row["linear_ops_s"] == pytest.approx(1e9 * 4096 / 8.0)
    assert row["limit"] == "amx-int8" and row["of_limit"] == pytest.approx(1e9 * 4096 / 8 / 2e12)
    # outside attention: linear in tokens; dense attention: quadratic
    assert row["projected_128k_s"] == pytest.approx(8.0 * 32 + 2.0 * 32 * 32)
    row.update(prefill="window", matmul="BF16")
    prefill.against_limit(row, {"vnni": 300e9})  # no BF16 instruction measured: no limit
    assert row["projected_128k_s"] == pytest.approx(8.0 * 32 + 2.0 * 32)
    assert row["limit"] is None and row["of_limit"] is None


def test_sampled_chunks_and_their_scaling():
    # the middle chunk of each of two equal spans; the whole read: the chunks' mean x the chunks
    assert prefill.sample_points(32768, 1024, 2) == [8, 24]
    assert prefill.sample_points(131072, 1024, 2) == [32, 96]
    assert prefill.sample_points(4096, 1024, 1) == [2]
    assert prefill.scale([1.0, 3.0], 131072, 1024) == pytest.approx(2.0 * 128)
    assert prefill.scale([2.0], 1500, 1024) == pytest.approx(4.0)  # a short last chunk counts


@pytest.mark.parametrize("peer", prefill.PEERS)
def test_llamacpp_reads_the_chunks_ktlong_samples(peer, tmp_path):
    """--peers: llama.cpp times the chunks ktlong times, each over a synthetic KV state of
    random tokens up to its start (its cache then ends where the chunk does), scaled alike."""
    from ktlong.bench.e2e import PEERS_HINT
    from ktlong.tinymodel import write_gguf

    pytest.importorskip("llama_cpp", reason=PEERS_HINT)
    gguf = str(write_gguf(hf_model("llama"), tmp_path / "m.gguf", "F32"))
    ours = prefill._worker("ktlong-window", gguf, 2048, 1, 512, 2)
    row = prefill._worker(peer, gguf, 2048, 1, 512, 2)
    assert row["runtime"] == peer and row["batch"] == prefill.PEER_BATCH
    assert row["sampled_at"] == ours["sampled_at"] == [512, 1536]
    assert row["cache_end"] == 2048  # 1,536 loaded, then the last chunk's 512 read
    assert len(row["chunk_s"]) == 2 and min(row["chunk_s"]) > 0
    assert row["prefill_s"] == pytest.approx(sum(row["chunk_s"]) * 4 / 2)
    assert ours["prefill_s"] == pytest.approx(sum(ours["chunk_s"]) * 4 / 2)
    assert row["prefill_tok_s"] == pytest.approx(2048 / row["prefill_s"])
    whole = prefill._worker(peer, gguf, 2048, 1, 512, 0)  # every token, from an empty cache
    assert whole["cache_end"] == 2048 and "chunk_s" not in whole
    assert 0.2 < row["prefill_s"] / whole["prefill_s"] < 5


def test_peers_need_a_gguf_and_a_known_name():
    from typer.testing import CliRunner

    from ktlong.cli import app

    run = CliRunner().invoke
    r = run(app, ["bench", "prefill", "--contexts", "1000", "--peers", "llamacpp-fa,ollama"])
    assert r.exit_code == 2 and r.output.count("\n") <= 2
    assert "ollama" in r.output and "llamacpp-nofa" in r.output
    r = run(app, ["bench", "prefill", "--contexts", "1000", "--peers", "llamacpp-fa",
                  "--model", str(hf_model("llama"))])
    assert r.exit_code == 2 and r.output.count("\n") <= 2 and "GGUF" in r.output
