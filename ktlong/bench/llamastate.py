"""A synthetic llama.cpp sequence state: a KV cache of N random tokens that llama.cpp loads with
`llama_state_seq_set_data`, so its decode at 128K+ is measured without hours of prefill.

The layout is llama.cpp's own (`llama_context::state_seq_write_data`, `llama_kv_cache::
state_write` in the llama.cpp that llama-cpp-python 0.3.x vendors), for one sequence, one stream:

    u32 magic 0xaf143cd8 · i32 seq_id, then per KV cache (one; two for a model with sliding-window
    layers, the full layers' and then the sliding layers', which keeps only the window's cells):
    u32 n_stream (1) · u32 cell_count
    cell_count x (i32 pos, u32 n_seq_id (1), i32 seq_id)
    u32 v_trans · u32 n_layer
    n_layer x (i32 ggml type, u64 row bytes, cell_count rows of K)      keys, layer by layer
    then values, layer by layer:
      v_trans 0 (flash attention on):  i32 type, u64 row bytes, cell_count rows
      v_trans 1 (flash attention off): i32 type, u32 element bytes, u32 kv_dim,
                                       kv_dim x cell_count elements (V transposed; F16)

llama.cpp checks the types and row sizes against its context's and refuses a mismatch, so a wrong
layout fails loudly (set_data returns 0) rather than decoding garbage.
"""
from __future__ import annotations

from typing import Any

import numpy as np

MAGIC = 0xAF143CD8
F16, Q8_0 = 1, 8  # ggml type ids
QK8_0 = 32  # values per Q8_0 block: one float16 scale, 32 int8
ROWS_AT_ONCE = 8192  # tokens of random rows made per step (bounds the temporaries)


def row_bytes(ggml_type: int, kv_dim: int) -> int:
    """Bytes of one token's K (or V) row of `kv_dim` values (all KV heads) in `ggml_type`."""
    if ggml_type == F16:
        return 2 * kv_dim
    if ggml_type == Q8_0:
        if kv_dim % QK8_0:
            raise ValueError(f"Q8_0 needs a row of whole blocks of {QK8_0}, got {kv_dim}")
        return kv_dim // QK8_0 * (2 + QK8_0)
    raise ValueError(f"ggml type {ggml_type}: only F16 ({F16}) and Q8_0 ({Q8_0}) are built")


def state_size(n_tokens: int, n_layers: int, kv_dim: int, ggml_type: int, swa_layers: int = 0,
               swa_window: int = 0) -> int:
    """Bytes of the state (V transposed or not: 12 bytes before each layer's V either way)."""
    size = 8 + _cache_size(n_tokens, n_layers, kv_dim, ggml_type)
    if swa_layers:
        size += _cache_size(min(swa_window, n_tokens), swa_layers, kv_dim, ggml_type)
    return size


def _cache_size(cells: int, n_layers: int, kv_dim: int, ggml_type: int) -> int:
    return 8 + 12 * cells + 8 + 2 * n_layers * (12 + cells * row_bytes(ggml_type, kv_dim))


def _random_rows(rng: np.random.Generator, n: int, kv_dim: int, ggml_type: int) -> np.ndarray:
    """[n, row_bytes] random rows of unit-scale values (what a layer's K or V looks like)."""
    if ggml_type == F16:
        return rng.standard_normal((n, kv_dim), np.float32).astype(np.float16).view(np.uint8)
    blocks = np.empty((n, kv_dim // QK8_0, 2 + QK8_0), np.uint8)
    blocks[:, :, :2] = np.array([1 / 64], np.float16).view(np.uint8)  # scale: |x| <= 2
    blocks[:, :, 2:] = rng.integers(-128, 128, blocks[:, :, 2:].shape, np.int8).view(np.uint8)
    return blocks.reshape(n, -1)


def seq_state(n_tokens: int, n_layers: int, kv_dim: int, ggml_type: int, seed: int = 0,
              seq_id: int = 0, v_trans: bool = False, swa_layers: int = 0,
              swa_window: int = 0) -> np.ndarray:
    """The state bytes [state_size(...)] uint8 of `n_tokens` random tokens at positions 0..n-1;
    `v_trans` for a context without flash attention (llama.cpp keeps V transposed there). With
    `swa_layers` (a model with sliding-window layers, as Gemma 3: llama.cpp's iSWA cache), the
    `n_layers` full layers' cache is followed by the sliding layers' one, which holds the last
    `swa_window` positions only."""
    if v_trans and ggml_type != F16:
        raise ValueError("a transposed V (no flash attention) is built in F16 only")
    out = np.empty(state_size(n_tokens, n_layers, kv_dim, ggml_type, swa_layers, swa_window),
                   np.uint8)
    out[:8] = np.array([MAGIC, seq_id], np.uint32).view(np.uint8)
    rng = np.random.default_rng(seed)
    off = _write_cache(out, 8, 0, n_tokens, n_layers, kv_dim, ggml_type, seq_id, v_trans, rng)
    if swa_layers:
        first = max(0, n_tokens - swa_window)
        off = _write_cache(out, off, first, n_tokens, swa_layers, kv_dim, ggml_type, seq_id,
                           v_trans, rng)
    assert off == out.size
    return out


def _write_cache(out: np.ndarray, off: int, first: int, end: int, n_layers: int, kv_dim: int,
                 ggml_type: int, seq_id: int, v_trans: bool, rng: np.random.Generator) -> int:
    """One KV cache's part (cells of positions first..end-1) at out[off:]; returns its end."""
    n_cells = end - first
    out[off:off + 8] = np.array([1, n_cells], np.uint32).view(np.uint8)  # one stream
    off += 8
    cells = np.empty((n_cells, 3), np.int32)  # pos, n_seq_id, seq_id
    cells[:, 0] = np.arange(first, end)
    cells[:, 1] = 1
    cells[:, 2] = seq_id
    out[off:off + 12 * n_cells] = cells.view(np.uint8).ravel()
    off += 12 * n_cells
    out[off:off + 8] = np.array([v_trans, n_layers], np.uint32).view(np.uint8)
    off += 8
    rb = row_bytes(ggml_type, kv_dim)
    for i in range(2 * n_layers):  # every layer's K, then every layer's V
        out[off:off + 4] = np.array([ggml_type], np.int32).view(np.uint8)
        if v_trans and i >= n_layers:  # element size, kv_dim; random values need no transpose
            out[off + 4:off + 12] = np.array([2, kv_dim], np.uint32).view(np.uint8)
        else:
            out[off + 4:off + 12] = np.array([rb], np.uint64).view(np.uint8)
        off += 12
        for t0 in range(0, n_cells, ROWS_AT_ONCE):
            n = min(ROWS_AT_ONCE, n_cells - t0)
            out[off:off + n * rb] = _random_rows(rng, n, kv_dim, ggml_type).ravel()
            off += n * rb
    return off


def load(llm: Any, spec: Any, n_tokens: int, flash: bool, ggml_type: int, seed: int = 0) -> None:
    """Load `n_tokens` random tokens at positions 0..n-1 into sequence 0 of a llama-cpp-python
    `Llama` whose context has flash attention `flash` and K, V in `ggml_type`; `spec`: its
    model's ktlong.spec (layers, KV width, sliding layers)."""
    import ctypes

    import llama_cpp

    swa = len(spec.sliding_layers)  # llama.cpp keeps the sliding layers' window apart
    full, kv_dim = spec.n_layers - swa, spec.n_kv_heads * spec.head_dim
    state = seq_state(n_tokens, full, kv_dim, ggml_type, seed=seed, v_trans=not flash,
                      swa_layers=swa, swa_window=spec.sliding_window or 0)
    ptr = state.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    if llama_cpp.llama_state_seq_set_data(llm.ctx, ptr, state.size, 0) != state.size:
        raise RuntimeError("llama.cpp refused the synthetic KV state (its layout changed?)")
