"""Issue 29, every error one line: a folder without weights, a truncated GGUF, out-of-range
flags, a cache folder that is a file, a demo too big for memory. Each ends in `error: ...`
(+ `hint: ...`) and exit 2, never a traceback."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ktlong import memory
from ktlong.cli import app
from ktlong.config import MAX_SEQ_LEN
from ktlong.errors import KtlongError
from ktlong.model import load_model
from ktlong.spec import read_spec

from .models import ARCHS, gguf_model, hf_model

runner = CliRunner()


def run(*args: str) -> object:
    return runner.invoke(app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1"})


def one_error(r: object, *words: str) -> str:
    """Exit 2 with `error: ...` and at most a `hint: ...` line on stderr; returns the error."""
    lines = r.stderr.splitlines()  # type: ignore[attr-defined]
    assert r.exit_code == 2, r.output  # type: ignore[attr-defined]
    assert "Traceback" not in r.output  # type: ignore[attr-defined]
    assert lines[-2 if lines[-1].startswith("hint: ") else -1].startswith("error: "), lines
    error = next(x for x in lines if x.startswith("error: "))
    for w in words:
        assert w in error, (w, error)
    return error


# --- 1. an HF folder with config and tokenizer but no weights -------------------------------------

def _without_weights(arch: str, tmp_path: Path) -> Path:
    folder = tmp_path / f"{arch}-no-weights"
    shutil.copytree(hf_model(arch), folder)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    return folder


@pytest.mark.parametrize("arch", ARCHS)
def test_spec_without_weights_is_estimated_from_the_config(arch: str, tmp_path: Path) -> None:
    full = read_spec(hf_model(arch))
    bare = read_spec(_without_weights(arch, tmp_path), need_weights=False)
    assert bare.weights_estimated and not full.weights_estimated
    assert bare.n_params == full.n_params  # the config's shape gives the exact count
    assert bare.weights_bytes == full.weights_bytes  # dtype float32: 4 bytes a parameter
    assert (bare.n_layers, bare.n_kv_heads, bare.head_dim) == (full.n_layers, full.n_kv_heads,
                                                               full.head_dim)


def test_estimate_follows_the_config_dtype(tmp_path: Path) -> None:
    folder = _without_weights("llama", tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("dtype", None)
    cfg["torch_dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(cfg))
    spec = read_spec(folder, need_weights=False)
    assert spec.weights_bytes == 2 * spec.n_params


def test_memcheck_and_inspect_model_work_without_weights(tmp_path: Path) -> None:
    folder = _without_weights("llama", tmp_path)
    r = run("memcheck", "--model", str(folder), "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["weights_estimated"] is True and data["weights_bytes"] > 0
    assert data["kv_bytes_per_token"] == {"BF16": 2 * 2 * 2 * 16 * 2}  # no Q8_0/Q4_0: head_dim 16
    assert data["recommended"]["kv_type"] == "BF16"
    one_error(run("memcheck", "--model", str(folder), "--kv-type", "Q4_0"),
              "kv_type Q4_0 needs a head_dim that is a multiple of 32; this model's is 16")
    r = run("memcheck", "--model", str(folder))
    assert r.exit_code == 0, r.output
    assert "estimate from config.json: the folder has no weight files" in r.stdout
    r = run("inspect", "model", str(folder), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["weights_estimated"] is True
    r = run("inspect", "model", str(folder))
    assert r.exit_code == 0, r.output
    assert "an estimate from config.json" in r.stdout


def test_loading_a_folder_without_weights_is_refused(tmp_path: Path) -> None:
    folder = _without_weights("llama", tmp_path)
    with pytest.raises(KtlongError, match="has no weights"):
        load_model(folder, device="CPU")
    doc = tmp_path / "doc.txt"
    doc.write_text("hello")
    r = run("chat", "-m", str(folder), "-f", str(doc), "-q", "hi")
    one_error(r, str(folder), "has no weights", "*.safetensors")


# --- 2. a truncated or damaged GGUF file ---------------------------------------------------------

@pytest.fixture(scope="module")
def gguf_bytes() -> bytes:
    return gguf_model("llama", "Q8_0").read_bytes()


def _cut(tmp_path: Path, data: bytes, n: int) -> Path:
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:n])
    return path


@pytest.mark.parametrize("where", ["half", "one byte short", "in the header", "empty"])
def test_truncated_gguf_is_one_line_from_every_entry_point(where: str, tmp_path: Path,
                                                           gguf_bytes: bytes) -> None:
    n = {"half": len(gguf_bytes) // 2, "one byte short": len(gguf_bytes) - 1,
         "in the header": 100, "empty": 0}[where]
    path = _cut(tmp_path, gguf_bytes, n)
    words = {"half": ["truncated", f"{n:,} bytes", f"header says {len(gguf_bytes):,}"],
             "one byte short": ["truncated", f"{n:,} bytes", f"header says {len(gguf_bytes):,}"],
             "in the header": ["truncated or damaged", "header", f"{n:,} bytes"],
             "empty": ["empty", "0 bytes"]}[where]
    for call in (lambda: read_spec(path), lambda: load_model(path, device="CPU")):
        with pytest.raises(KtlongError) as e:
            call()
        assert str(path) in e.value.message and all(w in e.value.message for w in words)
    for args in (["memcheck", "--model", str(path)], ["inspect", "model", str(path)],
                 ["chat", "-m", str(path), "-q", "hi"]):
        one_error(run(*args), str(path), *words)


def test_quantised_loader_refuses_a_truncated_file(tmp_path: Path, gguf_bytes: bytes) -> None:
    from ktlong.ggufload import load_quantised

    path = _cut(tmp_path, gguf_bytes, len(gguf_bytes) * 3 // 4)
    with pytest.raises(KtlongError, match="is truncated"):
        load_quantised(str(path), None, None, "ktlong")


def test_gguf_with_a_bad_magic_or_a_damaged_header(tmp_path: Path, gguf_bytes: bytes) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUX" + gguf_bytes[4:])
    one_error(run("memcheck", "--model", str(path)), "not a valid GGUF file", "'GGUF'")
    # a tensor count far beyond what the file could hold
    path.write_bytes(gguf_bytes[:8] + (1 << 40).to_bytes(8, "little") + gguf_bytes[16:])
    one_error(run("inspect", "model", str(path)), "not a valid GGUF file")


def test_truncated_gguf_in_a_subprocess_has_no_traceback(tmp_path: Path,
                                                         gguf_bytes: bytes) -> None:
    path = _cut(tmp_path, gguf_bytes, len(gguf_bytes) // 2)
    out = subprocess.run([sys.executable, "-m", "ktlong", "memcheck", "--model", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.splitlines() == [
        f"error: {path} is truncated: {len(gguf_bytes) // 2:,} bytes, but its header says "
        f"{len(gguf_bytes):,}", "hint: download or copy the file again"]


def test_whole_gguf_still_reads(gguf_bytes: bytes) -> None:
    spec = read_spec(gguf_model("llama", "Q8_0"))
    assert spec.format == "gguf" and spec.n_layers == 2


# --- 3. out-of-range max_seq_len; a cache folder that is a file ----------------------------------

def test_max_seq_len_out_of_range_gives_the_range() -> None:
    for args in (["inspect", "config", "--max-seq-len", "10000000000000"],
                 ["chat", "--demo", "--max-seq-len", "10000000000000", "-q", "hi"]):
        one_error(run(*args), "max_seq_len", "out of range", f"0..{MAX_SEQ_LEN}")
    r = run("inspect", "config", "max_seq_len", "--max-seq-len", "16M", "--json")
    assert r.exit_code == 0, r.output


def test_recommended_max_seq_len_stays_in_range() -> None:
    shape = memory.REFERENCE.__class__(n_layers=1, n_kv_heads=1, head_dim=1, weights_bytes=0,
                                       max_positions=0)
    assert memory.recommend_max_seq_len(shape, "BF16", 1 << 50) == MAX_SEQ_LEN


def test_cache_dir_that_is_a_file(tmp_path: Path) -> None:
    file = tmp_path / "not-a-folder"
    file.write_text("x")
    doc = tmp_path / "doc.txt"
    doc.write_text("hello")
    model = str(hf_model("llama"))
    for args in (["chat", "-m", model, "-f", str(doc), "-q", "hi", "--cache-dir", str(file)],
                 ["prefill", "-m", model, "-f", str(doc), "--cache-dir", str(file)],
                 ["inspect", "cache", "--cache-dir", str(file)]):
        one_error(run(*args), str(file), "is a file, not a folder")
    one_error(run("inspect", "cache", "--cache-dir", str(file / "sub")),
              f"{file} is a file, not a folder")


# --- 4. --demo-tokens: its cost, refused above memory ---------------------------------------------

def test_demo_tokens_beyond_free_memory_is_refused(ktlong_home: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "free_dram_bytes", lambda: 4 * 10**9)
    err = one_error(run("chat", "--demo", "--demo-tokens", "10M", "-q", "hi"),
                    "--demo-tokens 10,485,760", "of RAM", "4 GB is free", "KV cache")
    assert "10.7 GB of BF16 KV cache" in err  # the demo model: 1024 bytes a token
    assert not list((ktlong_home / "demo").glob("document-*"))  # refused before writing it


def test_demo_tokens_beyond_max_seq_len_says_what_it_costs(ktlong_home: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "free_dram_bytes", lambda: 100 * 10**9)
    r = run("chat", "--demo", "--demo-tokens", "10M", "--max-seq-len", "128K", "-q", "hi")
    one_error(r, "does not fit in max_seq_len 131,072", "10.7 GB of KV cache", "prefill ~")
    assert "--max-seq-len 10244K" in r.stderr.splitlines()[-1]
    assert not list((ktlong_home / "demo").glob("document-*"))


def test_demo_cost_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from ktlong import demo

    monkeypatch.setattr(memory, "free_dram_bytes", lambda: 100 * 10**9)
    line = demo.cost(1 << 20, "BF16", threads=2)
    assert line.startswith("1.07 GB of KV cache in RAM, as much on disk")
    secs = (1 << 20) / (demo.PREFILL_TOK_S_PER_CORE * 2)
    assert f"prefill ~{secs / 60:.0f} min on 2 cores" in line
    assert "exact prefill" in demo.cost(1 << 20, "BF16", threads=2, windowed=False)
    assert "prefill" not in demo.cost(4096, "BF16", model=hf_model("llama"))  # no speed known
