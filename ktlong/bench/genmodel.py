"""Random models at real widths, as GGUF files, for benchmarks (`bench e2e --shape 8b`).

Llama-3.1-8B's widths (hidden 4096, intermediate 14336, 32/8 heads, head_dim 128, vocab 128256)
with any number of layers. Weights are random (normal, std 0.02; norms 1), written tensor by
tensor so memory stays near one tensor. The tokenizer is the small byte-level BPE of
ktlong.tinymodel, its token list padded with reserved tokens to the model's vocab; benchmarks feed
token ids, so every runtime sees the same ids.

Quantised files come from llama.cpp's own quantizer when llama-cpp-python is installed (an F16
file is written first, then quantised: Q4_K_M, Q8_0, Q6_K as llama.cpp makes them), else from
ktlong's quantiser with llama.cpp's Q4_K_M recipe (Q6_K for the output, and for attn_v and
ffn_down on the layers llama.cpp gives more bits). `origin` says which.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

SHAPES = {"8b": dict(hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128,
                     vocab=128256)}
WEIGHTS = {"q4_k_m": 15, "q8_0": 7, "q6_k": 18, "f16": 1}  # -> llama.cpp's ftype
_ONE_TYPE = {"q8_0": "Q8_0", "q6_k": "Q6_K", "f16": "F16"}


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get Q6_K in Q4_K_M."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(name: str, weights: str, n_layers: int) -> str:
    """The GGUF type ktlong's quantiser gives tensor `name` for a `weights` recipe."""
    if name.endswith("_norm.weight"):
        return "F32"
    if weights != "q4_k_m":
        return _ONE_TYPE[weights]
    if name == "output.weight":
        return "Q6_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        return "Q6_K" if _more_bits(int(name.split(".")[1]), n_layers) else "Q4_K"
    return "Q4_K"


def _tensors(cfg: Any) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape [rows, k]) of every tensor of a llama of `cfg`'s shape."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv, ff = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size
    out = [("token_embd.weight", (cfg.vocab_size, h))]
    for i in range(cfg.num_hidden_layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (h,)), (b + "attn_q.weight", (q, h)),
                (b + "attn_k.weight", (kv, h)), (b + "attn_v.weight", (kv, h)),
                (b + "attn_output.weight", (h, q)), (b + "ffn_norm.weight", (h,)),
                (b + "ffn_gate.weight", (ff, h)), (b + "ffn_up.weight", (ff, h)),
                (b + "ffn_down.weight", (h, ff))]
    return out + [("output_norm.weight", (h,)), ("output.weight", (cfg.vocab_size, h))]


def _values(shape: tuple[int, ...], seed: int, qtype: str) -> np.ndarray:
    """A random tensor in `qtype`'s bytes, made a block of rows at a time."""
    from ktlong import quant

    if len(shape) == 1:
        return np.ones(shape, np.float32)
    rows, k = shape
    rng = np.random.default_rng(seed)
    step = max(1, (1 << 24) // k)  # 16M values (64 MB of float32) at a time
    parts = []
    for r0 in range(0, rows, step):
        x = rng.standard_normal((min(step, rows - r0), k), dtype=np.float32) * np.float32(0.02)
        parts.append(quant.quantize(x, qtype))
    out = np.concatenate(parts)
    return out.view(np.float16) if qtype == "F16" else out


def write_random_gguf(out_file: Path, shape: str | dict[str, int], layers: int, weights: str,
                      log: Callable[[str], None] | None = None) -> Path:
    """Write a random model of `shape` (a SHAPES name or such a dict) with `layers` layers, its
    tensors in the `weights` recipe (ktlong's quantiser)."""
    import gguf

    from ktlong import quant
    from ktlong.tinymodel import build_tokenizer, gguf_header, make_config

    s = SHAPES[shape] if isinstance(shape, str) else shape
    tok = build_tokenizer()
    cfg = make_config("llama", layers=layers, hidden=s["hidden"], heads=s["heads"],
                      kv_heads=s["kv_heads"], head_dim=s["head_dim"],
                      intermediate=s["intermediate"], vocab=s["vocab"], max_positions=1 << 20,
                      rope_theta=500000.0)
    w = gguf.GGUFWriter(str(out_file), "llama")
    gguf_header(w, cfg, tok, vocab=s["vocab"])
    plan = [(name, shp, tensor_type(name, weights, layers)) for name, shp in _tensors(cfg)]
    for name, shp, qt in plan:
        t = quant.TYPES[qt]
        nbytes = t.tensor_bytes(shp[0], shp[1]) if len(shp) == 2 else 4 * shp[0]
        raw = gguf.GGMLQuantizationType[qt]
        w.add_tensor_info(name, shp if qt in ("F32", "F16") else (shp[0], t.row_bytes(shp[1])),
                          np.dtype(np.float32 if qt == "F32" else
                                   np.float16 if qt == "F16" else np.uint8), nbytes,
                          raw_dtype=None if qt in ("F32", "F16") else raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for i, (name, shp, qt) in enumerate(plan):
        if log and len(shp) == 2:
            log(f"writing {name} ({qt}) {i + 1}/{len(plan)}")
        w.write_tensor_data(_values(shp, i, qt))
    w.close()
    return out_file


def build(folder: Path, shape: str, layers: int, weights: str,
          log: Callable[[str], None] | None = None) -> tuple[Path, str]:
    """The benchmark's GGUF file in `folder` (reused if present); returns (path, origin)."""
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"random-{shape}-{layers}L-{weights}.gguf"
    origin_file = final.with_suffix(".origin")
    if final.exists() and origin_file.exists():
        return final, origin_file.read_text()
    try:
        import llama_cpp
    except Exception:
        llama_cpp = None
    if llama_cpp is None or weights == "f16":
        write_random_gguf(final.with_suffix(".part"), shape, layers, weights, log)
        origin = "ktlong's quantiser" if weights != "f16" else "F16, written by ktlong"
    else:
        f16 = folder / f"random-{shape}-{layers}L-f16.gguf"
        if not f16.exists():
            write_random_gguf(f16.with_suffix(".part"), shape, layers, "f16", log)
            f16.with_suffix(".part").rename(f16)
        if log:
            log(f"quantising to {weights} with llama.cpp")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = WEIGHTS[weights]
        rc = llama_cpp.llama_model_quantize(str(f16).encode(),
                                            str(final.with_suffix(".part")).encode(), params)
        if rc != 0:
            raise RuntimeError(f"llama.cpp's quantizer failed ({rc})")
        origin = f"llama.cpp {llama_cpp.__version__} quantizer"
    final.with_suffix(".part").rename(final)
    origin_file.write_text(origin)
    return final, origin
