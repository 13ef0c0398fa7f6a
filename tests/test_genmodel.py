"""The benchmark's random models at real widths: llama.cpp's Q4_K_M recipe, and a file ktlong
loads and runs (a small shape here; `bench e2e --shape 8b` writes the real one)."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from ktlong.bench import genmodel
from ktlong.model import load_model
from ktlong.spec import read_spec

SMALL = dict(hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64, vocab=1024)


def test_q4_k_m_recipe_is_llama_cpp_s():
    n = 32
    v = [i for i in range(n) if genmodel.tensor_type(f"blk.{i}.attn_v.weight", "q4_k_m", n)
         == "Q6_K"]
    # llama.cpp: the first and last eighth, and every third layer between
    assert v == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert genmodel.tensor_type("output.weight", "q4_k_m", n) == "Q6_K"
    assert genmodel.tensor_type("blk.5.ffn_up.weight", "q4_k_m", n) == "Q4_K"
    assert genmodel.tensor_type("blk.5.attn_norm.weight", "q4_k_m", n) == "F32"
    assert genmodel.tensor_type("token_embd.weight", "q8_0", n) == "Q8_0"


def test_random_gguf_has_the_shape_and_types_and_runs(tmp_path):
    path = genmodel.write_random_gguf(tmp_path / "m.gguf", SMALL, 3, "q4_k_m")
    spec = read_spec(path)
    assert (spec.n_layers, spec.hidden_size, spec.n_heads, spec.n_kv_heads, spec.head_dim,
            spec.vocab_size) == (3, 256, 4, 2, 64, 1024)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert types["output.weight"] == "Q6_K" and types["blk.1.ffn_gate.weight"] == "Q4_K"
    assert spec.weights_bytes == path.stat().st_size - _header_bytes(path)
    lm = load_model(path, device="CPU")
    assert lm.weight_type == "GGUF Q4_K+Q6_K"
    x = lm.model.get_input_embeddings()(torch.tensor([[1, 2, 3]]))
    assert x.shape == (1, 3, 256) and torch.isfinite(x).all()
    assert 0.005 < float(x.std()) < 0.05  # std 0.02, through Q4_K


def _header_bytes(path):
    r = gguf.GGUFReader(str(path))
    return int(r.tensors[0].data_offset)


def test_build_reuses_a_finished_file_and_never_a_partial_one(tmp_path, monkeypatch):
    calls = []

    def fake(out, shape, layers, weights, log=None):
        calls.append(out.name)
        out.write_bytes(b"x")
        return out

    monkeypatch.setattr(genmodel, "write_random_gguf", fake)
    monkeypatch.setitem(__import__("sys").modules, "llama_cpp", None)  # ktlong's quantiser
    (tmp_path / "random-8b-2L-q8_0.part").write_bytes(b"half")  # an interrupted earlier run
    path, origin = genmodel.build(tmp_path, "8b", 2, "q8_0")
    assert path.name == "random-8b-2L-q8_0.gguf" and origin == "ktlong's quantiser"
    assert genmodel.build(tmp_path, "8b", 2, "q8_0") == (path, origin)
    assert calls == ["random-8b-2L-q8_0.part"] and not np.any([p.suffix == ".part"
                                                               for p in tmp_path.iterdir()])
