"""The Typer app: help without heavy imports, the one error handler, memcheck, inspect config."""
from __future__ import annotations

import json
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ktlong import memory, render
from ktlong.cli import app
from ktlong.config import CHUNK_AUTO

runner = CliRunner()


def run(*args: str, **env: str) -> object:
    return runner.invoke(app, list(args), env={"COLUMNS": "200", **env})


# --- help, version, imports ---------------------------------------------------------------------

def test_help_lists_subcommands() -> None:
    r = run("--help")
    assert r.exit_code == 0
    for name in ("memcheck", "inspect", "bench", "--install-completion"):
        assert name in r.stdout
    r = run()  # no arguments: the help, not an error message
    assert "Usage" in r.output and "memcheck" in r.output
    assert "config" in run("inspect", "--help").stdout
    assert "decode" in run("bench", "--help").stdout
    assert run("--version").stdout.strip() == "ktlong 0.1.0"


@pytest.mark.parametrize("args", [["--help"], ["inspect", "--help"], ["bench", "decode", "--help"],
                                  ["memcheck", "--help"]])
def test_help_imports_no_heavy_module(args: list[str]) -> None:
    code = ("import sys\nfrom ktlong.cli import main\ntry:\n    main(sys.argv[1:])\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "print('HEAVY', [m for m in ('torch', 'transformers', 'numba') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("HEAVY []")
    assert "Usage" in out.stdout


def test_console_script_and_module_entry(ktlong_home: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "ktlong", "memcheck", "--model", "/no/such/model"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.startswith("error: model path /no/such/model does not exist\nhint: ")
    assert out.stdout == ""


# --- the one error handler ----------------------------------------------------------------------

def test_user_error_is_one_line_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    r = run("memcheck", "--model", str(tmp_path / "empty"))
    assert r.exit_code == 2
    assert r.stderr.splitlines()[0] == f"error: {tmp_path / 'empty'} is not a model folder: " \
                                       "no config.json"
    assert len(r.stderr.splitlines()) == 2 and r.stderr.splitlines()[1].startswith("hint: ")


def test_unsupported_architecture(shape_dir: Callable[..., Path]) -> None:
    r = run("memcheck", "--model", str(shape_dir(model_type="gpt2")))
    assert r.exit_code == 2 and "architecture 'gpt2' is not supported" in r.stderr


def test_unexpected_error_exit_1_and_debug(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> int:
        raise RuntimeError("disk on fire\nsecond line")

    monkeypatch.setattr(memory, "free_dram_bytes", boom)
    r = run("memcheck")
    assert r.exit_code == 1
    assert r.stderr == ("error: RuntimeError: disk on fire (set KTLONG_DEBUG=1 for the "
                        "traceback)\n")
    r = run("memcheck", KTLONG_DEBUG="1")
    assert isinstance(r.exception, RuntimeError) and "disk on fire" in str(r.exception)


def test_usage_errors_stay_usage_errors() -> None:
    r = run("inspect", "config", "--no-such-flag")
    assert r.exit_code == 2 and "No such option" in r.output


def test_no_color_is_respected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    assert render.console().no_color
    monkeypatch.delenv("NO_COLOR")
    assert not render.console().no_color


# --- memcheck -----------------------------------------------------------------------------------

def test_memcheck_reference_shape_says_so() -> None:
    r = run("memcheck")
    assert r.exit_code == 0, r.output
    assert "no --model given" in r.stdout and "reference shape" in r.stdout
    assert "17.2 GB" in r.stdout and "recommended: max_seq_len" in r.stdout


def test_memcheck_model_json(shape_dir: Callable[..., Path],
                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "free_dram_bytes", lambda: 100 * 10**9)
    model = shape_dir()
    r = run("memcheck", "--model", str(model), "--kv-type", "fp16", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["model"] == str(model) and data["kv_type"] == "FP16"
    assert data["kv_types"] == ["FP16"]  # --kv-type narrows the table to it
    assert data["kv_bytes_per_token"] == {"FP16": 131072}
    assert data["free_dram_bytes"] == 100 * 10**9
    rows = {row["label"]: row for row in data["rows"]}
    assert set(rows) == {"4K", "32K", "64K", "128K", "256K (model max)", "512K", "1M"}
    assert rows["128K"]["kv_bytes"] == 131072 * 131072
    assert memory.gb(rows["128K"]["kv_bytes"]) == "17.2 GB"
    # the default (sparse) attention reads past the model's 256K positions: up to 1M
    assert data["recommended_max_seq_len"] == memory.recommend_max_seq_len(
        memory.REFERENCE.__class__(n_layers=32, n_kv_heads=8, head_dim=128,
                                   weights_bytes=data["weights_bytes"], max_positions=262144),
        "FP16", 100 * 10**9, cap=1 << 20) > 262144
    assert data["recommended"]["kv_type"] == "FP16" and data["recommended"]["kv_tier"] == "RAM"
    assert data["written"] is None


def test_memcheck_text_table_for_a_model(shape_dir: Callable[..., Path]) -> None:
    r = run("memcheck", "--model", str(shape_dir()), "--kv-type", "FP16")
    assert r.exit_code == 0, r.output
    assert "KV bytes per token: FP16 131,072" in r.stdout and "17.2 GB" in r.stdout
    assert "Q8_0" not in r.stdout.split("KV bytes per token")[1].splitlines()[0]
    assert "256K*" in r.stdout and "reference" not in r.stdout


def test_memcheck_gguf_reads_metadata_only(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    path = tmp_path / "shape.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(28)
    w.add_context_length(32768)
    w.add_embedding_length(3584)
    w.add_head_count(28)
    w.add_head_count_kv(4)
    w.add_tensor("token_embd.weight", np.zeros((8, 16), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = run("memcheck", "--model", str(path), "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["arch"] == "qwen2" and data["max_positions"] == 32768
    assert data["kv_bytes_per_token"]["BF16"] == 2 * 28 * 4 * 128 * 2  # head_dim 3584 / 28
    assert data["kv_bytes_per_token"]["Q4_0"] == 2 * 28 * 4 * 72
    assert [row["label"] for row in data["rows"]][3:6] == ["32K (model max)"] * 3
    (tmp_path / "notes.txt").write_text("hello")
    r = run("memcheck", "--model", str(tmp_path / "notes.txt"))
    assert r.exit_code == 2 and "is not a model" in r.stderr


def test_memcheck_write_edits_only_those_lines(ktlong_home: Path, shape_dir: Callable[..., Path],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "free_dram_bytes", lambda: 40 * 10**9)
    monkeypatch.setattr(memory, "free_disk_bytes", lambda folder: 10**12)
    assert run("inspect", "config").exit_code == 0  # first run writes config.yaml
    path = ktlong_home / "config.yaml"
    text = path.read_text().replace("top_k: 0", "top_k: 5  # my choice")
    text = text.replace("kv_type: BF16", "kv_type: Q4_0  # was BF16")
    path.write_text(text)
    r = run("memcheck", "--model", str(shape_dir()), "--write", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    rec = data["recommended_max_seq_len"]
    # 256K of BF16 KV (34.4 GB) + 10% + 2 GiB fits in 40 GB: the full context, in RAM
    assert data["recommended"] == {"max_seq_len": 262144, "kv_type": "BF16", "kv_tier": "RAM",
                                   "why": data["recommended"]["why"]} and rec == 262144
    assert data["written"] == str(path)
    new = path.read_text()
    assert yaml.safe_load(new)["max_seq_len"] == rec and yaml.safe_load(new)["top_k"] == 5
    old_lines, new_lines = text.splitlines(), new.splitlines()
    changed = [(a, b) for a, b in zip(old_lines, new_lines, strict=True) if a != b]
    assert changed == [(next(x for x in old_lines if x.startswith("max_seq_len:")),
                        f"max_seq_len: {rec}"),
                       ("kv_type: Q4_0  # was BF16", "kv_type: BF16  # was BF16"),
                       ("kv_tier: AUTO", "kv_tier: RAM")]


def test_memcheck_writes_the_disk_tier_when_ram_is_short(ktlong_home: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference 8B (BF16 weights, 16.1 GB, 128K) with 20 GB free: 1.79 GB left for the KV,
    Q4_0 (40,550 bytes a token with the 10%) reaches 43K in RAM; with the KV on disk Q8_0 holds
    128K (a 9.13 GB file, 19.4 GB of RAM) when the disk has room, else Q4_0 (4.83 GB)."""
    monkeypatch.setattr(memory, "free_dram_bytes", lambda: 20 * 10**9)
    monkeypatch.setattr(memory, "free_disk_bytes", lambda folder: 60 * 10**9)
    r = run("memcheck", "--write")
    assert r.exit_code == 0, r.output
    assert ("recommended: max_seq_len 131,072, kv_type Q8_0, kv_tier DISK (in free RAM at most "
            "43K tokens fit (Q4_0); with the KV on disk Q8_0 reaches the full context (128K))"
            in r.stdout)
    assert "longest context in free RAM: BF16 12K, Q8_0 22K, Q4_0 43K" in r.stdout
    # BF16 on disk: its 2.18 GB decode step does not fit beside the weights; the others reach
    # past the model's 128K (read with blocks) as far as the disk holds
    assert "longest with the KV on disk: BF16 13K, Q8_0 826K, Q4_0 1M" in r.stdout
    cfg = yaml.safe_load((ktlong_home / "config.yaml").read_text())
    assert (cfg["max_seq_len"], cfg["kv_type"], cfg["kv_tier"]) == (131072, "Q8_0", "DISK")
    lines = [line.split() for line in r.stdout.splitlines()]
    i = next(n for n, words in enumerate(lines) if words and words[0] == "128K*")
    assert [w[-1] for w in lines[i : i + 3]] == ["no", "disk", "disk"]  # BF16, Q8_0, Q4_0
    assert lines[i][2:4] == ["BF16", "17.2"] and lines[i + 1][0:2] == ["Q8_0", "9.13"]
    monkeypatch.setattr(memory, "free_disk_bytes", lambda folder: 8 * 10**9)
    r = run("memcheck", "--write", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["recommended"]["kv_type"] == "Q4_0" and data["free_disk_bytes"] == 8 * 10**9
    assert data["longest"]["Q8_0"]["DISK"] < 131072 < data["longest"]["Q4_0"]["DISK"]
    assert data["recommended"]["max_seq_len"] == 131072  # the disk tier: the model's own
    cfg = yaml.safe_load((ktlong_home / "config.yaml").read_text())
    assert (cfg["max_seq_len"], cfg["kv_type"], cfg["kv_tier"]) == (131072, "Q4_0", "DISK")
    # --kv-type is kept: only the tier and the length are chosen
    monkeypatch.setattr(memory, "free_disk_bytes", lambda folder: 60 * 10**9)
    r = run("memcheck", "--kv-type", "bf16", "--json")
    data = json.loads(r.stdout)
    assert data["kv_types"] == ["BF16"] and data["written"] is None
    assert data["recommended"] == {  # 12K in RAM; on disk the 2.18 GB decode step limits it
        "max_seq_len": 13312, "kv_type": "BF16", "kv_tier": "DISK",
        "why": "in free RAM at most 12K tokens fit (BF16); with the KV on disk BF16 reaches the "
               "most (13K)"}


def test_memcheck_write_refuses_when_nothing_fits(ktlong_home: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "free_dram_bytes", lambda: 10**9)
    monkeypatch.setattr(memory, "free_disk_bytes", lambda folder: 10**12)
    assert run("inspect", "config").exit_code == 0
    before = (ktlong_home / "config.yaml").read_text()
    r = run("memcheck", "--write")  # the weights alone (16.1 GB) do not fit, whatever the tier
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 2
    assert r.stderr.startswith("error: no context length fits in free RAM or on free disk")
    assert (ktlong_home / "config.yaml").read_text() == before


def test_demo_refuses_a_disk_tier_the_disk_cannot_hold(ktlong_home: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With kv_tier DISK the preflight checks the disk for the tier file (max_seq_len of KV:
    the demo model's 1,024 bytes a token x 1M = 1.07 GB, + 1 GiB kept free), not RAM."""
    monkeypatch.setattr(memory, "free_dram_bytes", lambda: 10**12)
    monkeypatch.setattr(memory, "free_disk_bytes", lambda folder: 2 * 10**9)
    r = run("chat", "--demo", "--demo-tokens", "64K", "--max-seq-len", "1M", "--set",
            "kv_tier=DISK", "-q", "hi")
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 2
    assert r.stderr.startswith("error: --demo-tokens 65,536: the KV disk tier needs 1.07 GB in "
                               f"{ktlong_home / 'cache' / 'tier'} for max_seq_len 1,048,576")
    assert "hint: lower max_seq_len to 883K or less" in r.stderr  # (2 GB - 1 GiB) / 1,024
    assert not list((ktlong_home / "demo").glob("document-*"))
    monkeypatch.setattr(memory, "free_disk_bytes", lambda folder: 3 * 10**9)  # room: no refusal
    from ktlong import demo

    line = demo.cost(65536, "BF16", settings=memory.Settings(kv_tier="DISK", max_seq_len=1 << 20))
    assert line.startswith("67.1 MB of KV cache on disk (kv_tier DISK)")


# --- inspect config -----------------------------------------------------------------------------

def test_inspect_config_json_sources(ktlong_home: Path) -> None:
    r = run("inspect", "config", "--json", "--profile", "kvretrieval", "--set", "top_k=40",
            "--kv-type", "fp32", "--max-seq-len", "64K", KTLONG_CHUNK_SIZE="2048")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    s, src = data["settings"], data["sources"]
    assert (s["top_k"], src["top_k"]) == (40, "flag")
    assert (s["kv_type"], src["kv_type"]) == ("FP32", "flag")
    assert (s["max_seq_len"], src["max_seq_len"]) == (65536, "flag")
    assert (s["chunk_size"], src["chunk_size"]) == (2048, "env:KTLONG_CHUNK_SIZE")
    assert (s["dense_layer_num"], src["dense_layer_num"]) == (2, "profile:kvretrieval")
    assert src["block_size"] == f"config:{ktlong_home / 'config.yaml'}"
    assert data["config_file"] == str(ktlong_home / "config.yaml")


def test_inspect_config_shows_what_was_fitted_to_a_model(shape_dir: Callable[..., Path],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "free_dram_bytes", lambda: 20 * 10**9)
    model = str(shape_dir(max_position_embeddings=8192))
    r = run("inspect", "config", "-m", model, "--json", "--set", "init_len=256")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    s, src = data["settings"], data["sources"]
    fitted = "fitted to the model's trained context 8,192"
    assert (s["local_windows_len"], src["local_windows_len"]) == (512, fitted)
    assert (s["second_select_num"], src["second_select_num"]) == (42, fitted)  # 256+42x128+512
    assert (s["init_len"], src["init_len"]) == (256, "flag")
    assert src["block_size"].startswith("config:") and src["max_seq_len"].startswith("auto: ")
    assert s["max_seq_len"] > 8192 and r.stderr.startswith(f"note: {fitted} tokens: ")
    r = run("inspect", "config", "-m", model, "local_windows_len", "max_seq_len", "block_size")
    assert r.exit_code == 0, r.output
    assert fitted in r.stdout and "auto: what fits in free RAM" in r.stdout
    assert "│ config " in r.stdout  # block_size: the default, as config.yaml has it
    r = run("inspect", "config", "local_windows_len", "--json")  # no model: nothing fitted
    assert json.loads(r.stdout)["settings"]["local_windows_len"] == 4096 and not r.stderr


def test_memcheck_marks_lengths_past_the_trained_context(shape_dir: Callable[..., Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "free_dram_bytes", lambda: 20 * 10**9)
    model = str(shape_dir(max_position_embeddings=8192))
    data = json.loads(run("memcheck", "-m", model, "--kv-type", "bf16", "--json").stdout)
    assert data["trained_context"] == 8192
    assert [(r["tokens"], r["past_trained"]) for r in data["rows"]][:3] == [
        (4096, False), (8192, False), (32768, True)]
    assert data["step_tokens"] == (1 + 43 + 4 + 1) * 128  # the budget fitted to 8K
    r = run("memcheck", "-m", model, "--kv-type", "bf16")
    assert r.exit_code == 0, r.output
    rows = {w[0]: w for w in map(str.split, r.stdout.splitlines()) if w and w[0][0].isdigit()}
    assert rows["32K"][-1] == "blocks" and rows["4K"][-1] == "RAM"
    assert ("past trained: longer than the model's trained context (8,192 tokens); read with "
            "blocks: a decode step reads 6,272 tokens") in r.stdout
    # auto: (20 GB - 2 GiB) / (128 KiB a token + 10%) = 123,822 tokens, in whole K
    assert "configured: max_seq_len 122,880 (auto: what fits this model)" in r.stdout
    assert "memcheck --write" not in r.stdout  # the recommendation (8K, in RAM) reaches less
    dense = run("memcheck", "-m", model, "--kv-type", "bf16", "--profile", "dense")
    assert "attention DENSE reads it from distances" in dense.stdout
    long = shape_dir("long", max_position_embeddings=1 << 20)  # every row inside its training
    assert "past trained" not in run("memcheck", "--model", str(long)).stdout


def test_demo_past_the_old_8b_limit_is_not_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """max_seq_len 0 fits the demo model (1 KB of KV a token), not an 8B's 44K."""
    from ktlong import chat

    seen = {}
    monkeypatch.setattr(memory, "free_dram_bytes", lambda: 24 * 10**9)
    monkeypatch.setattr(chat, "run", lambda model, files, st, **kw: seen.setdefault("st", st)
                        and 0)
    r = run("chat", "--demo", "--demo-tokens", "64K", "-q", "hi")
    assert r.exit_code == 0, r.output
    assert seen["st"].max_seq_len == 1 << 20 and "does not fit" not in r.stderr


def test_inspect_config_table_explain_and_keys() -> None:
    r = run("inspect", "config", "--explain", "anchor_type", "block_size")
    assert r.exit_code == 0, r.output
    assert "DYNAMIC|MAX|MEAN|QUEST|FIX" in r.stdout and "block_size" in r.stdout
    assert "kv_type" not in r.stdout
    r = run("inspect", "config", "--json", "--explain", "top_p")
    assert json.loads(r.stdout)["fields"]["top_p"]["allowed"] == "float 0.0..1.0"


@pytest.mark.parametrize("args,words", [
    (["--set", "blok_size=3"], ["unknown setting 'blok_size'", "did you mean 'block_size'"]),
    (["--set", "block_size"], ["--set 'block_size' is not KEY=VALUE"]),
    (["--profile", "nope"], ["no profile named 'nope'", "streamingllm"]),
    (["--set", "anchor_type=quest"], ["QUEST needs anchor_num 2"]),
    (["--threads", "-1"], ["threads_num = -1 is out of range"]),
    (["not_a_key"], ["unknown setting 'not_a_key'"]),
])
def test_inspect_config_bad_input(args: list[str], words: list[str]) -> None:
    r = run("inspect", "config", *args)
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("error: ")
    for w in words:
        assert w in r.stderr


def test_config_yaml_errors_through_the_cli(ktlong_home: Path) -> None:
    ktlong_home.mkdir()
    (ktlong_home / "config.yaml").write_text("block_size: 64\nkv_type: {FP16\n")
    r = run("inspect", "config")
    assert r.exit_code == 2 and "YAML syntax error" in r.stderr
    assert (ktlong_home / "config.yaml").read_text() == "block_size: 64\nkv_type: {FP16\n"


# --- bench --------------------------------------------------------------------------------------

def test_bench_decode_passes_parsed_options(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict] = []
    fake = types.ModuleType("ktlong.bench.decode")
    fake.main = lambda **kw: calls.append(kw)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ktlong.bench.decode", fake)
    import ktlong.bench

    monkeypatch.setattr(ktlong.bench, "decode", fake, raising=False)
    r = run("bench", "decode", "--contexts", "16K, 65536,1M", "--repeats", "2", "-t", "1", "--json")
    assert r.exit_code == 0, r.output
    assert calls == [dict(contexts=[16384, 65536, 1048576], repeats=2, threads=1, as_json=True,
                          quest=False, plot_file=None, kv_types=["BF16"],
                          command="ktlong bench decode --contexts 16K,65536,1M --repeats 2 -t 1")]
    r = run("bench", "decode", "--contexts", "1M", "--quest")
    assert r.exit_code == 0, r.output
    assert calls[-1]["quest"] is True and calls[-1]["contexts"] == [1048576]
    r = run("bench", "decode", "--contexts", "16K", "--kv-type", "q8_0, BF16,Q8_0")
    assert r.exit_code == 0, r.output
    assert calls[-1]["kv_types"] == ["Q8_0", "BF16"]
    assert calls[-1]["command"].endswith(" --kv-type Q8_0,BF16")
    r = run("bench", "decode", "--contexts", "16K,lots")
    assert r.exit_code == 2 and "--contexts '16K,lots'" in r.stderr
    assert len(calls) == 3


def test_bench_decode_with_a_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """-m: a real model's file goes to the runner (not a shape to build); a missing model, or a
    model and a shape both, is one line and exit 2 before any worker starts."""
    from ktlong.bench import decodemodel
    from ktlong.tinymodel import write_gguf

    from .models import hf_model

    calls: list[tuple] = []
    monkeypatch.setattr(decodemodel, "run", lambda *a: calls.append(a) or {"rows": []})
    gguf = write_gguf(hf_model("llama"), tmp_path / "m.gguf", "F32")
    r = run("bench", "decode", "-m", str(gguf), "--contexts", "16K", "--steps", "4", "--json")
    assert r.exit_code == 0, r.output
    assert calls[0][6] == gguf and json.loads(r.stdout)["command"].startswith(
        "ktlong bench decode -m m.gguf --contexts 16K")
    assert calls[0][11] == "prose"  # a chat's KV by default, not random rows
    r = run("bench", "decode", "-m", str(gguf), "--kv", "random", "--kv-tier", "disk", "--json")
    assert r.exit_code == 0 and calls[1][11] == "random" and " --kv random" in r.stdout
    r = run("bench", "decode", "-m", str(gguf), "--kv-tier", "disk")
    assert r.exit_code == 2 and "--kv random" in r.stderr
    r = run("bench", "decode", "-m", str(tmp_path / "nope.gguf"), "--contexts", "16K")
    assert r.exit_code == 2 and "does not exist" in r.stderr and "Traceback" not in r.output
    r = run("bench", "decode", "-m", str(gguf), "--shape", "8b")
    assert r.exit_code == 2 and "give one" in r.stderr
    assert len(calls) == 2


def test_bench_prefill_passes_chunk_sizes_and_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []
    fake = types.ModuleType("ktlong.bench.prefill")
    fake.main = lambda *a: calls.append(a)  # type: ignore[attr-defined]
    fake.MODES = ("dense", "window", "minference")  # type: ignore[attr-defined]
    fake.SHAPES = {"small": {}, "8b": {}}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ktlong.bench.prefill", fake)
    import ktlong.bench

    monkeypatch.setattr(ktlong.bench, "prefill", fake, raising=False)
    r = run("bench", "prefill", "--contexts", "16K", "--chunk-sizes", "512,1K", "-t", "1")
    assert r.exit_code == 0, r.output
    assert calls[0][:8] == ([16384], 1, False, None, (512, 1024), ("dense",), True, "small")
    r = run("bench", "prefill", "--contexts", "8K")  # default: the chunk ktlong uses on the CPU
    assert r.exit_code == 0, r.output
    assert calls[-1][4] == (CHUNK_AUTO[False],)
    r = run("bench", "prefill", "--modes", "Dense,minference", "--shape", "8b",
            "--sample-chunks", "3", "--no-transformers")
    assert r.exit_code == 0, r.output
    assert calls[-1][5:9] == (("dense", "minference"), False, "8b", 3)
    assert "--sample-chunks 3" in calls[-1][9]
    r = run("bench", "prefill", "--chunk-sizes", "0")
    assert r.exit_code == 2 and "--chunk-sizes '0'" in r.stderr
    r = run("bench", "prefill", "--modes", "dense,sparse")
    assert r.exit_code == 2 and "unknown sparse" in r.stderr
    assert len(calls) == 3
