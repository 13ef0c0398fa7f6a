"""The decode step ktlong runs itself (ktlong.decoder) against the model's own modules, and its
small kernels (kernels/layer.py) against NumPy references."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from ktlong import decoder, kernels
from ktlong.engine import Session, position_embeddings
from ktlong.model import load_model
from ktlong.tinymodel import make_model
from tests.models import ARCHS, gguf_model, hf_model, settings


def test_layer_kernels_match_their_references():
    rng = np.random.default_rng(0)
    for plus_one in (False, True):
        x = rng.standard_normal((3, 64)).astype(np.float32)
        w = rng.standard_normal(64).astype(np.float32)
        out = kernels.rmsnorm(x.copy(), w, 1e-6, plus_one, np.empty_like(x))
        np.testing.assert_allclose(out, kernels.rmsnorm_ref(x, w, 1e-6, plus_one), rtol=1e-5,
                                   atol=1e-5)
    x1 = rng.standard_normal(96).astype(np.float32)
    w1 = rng.standard_normal(96).astype(np.float32)
    got = kernels.rmsnorm(x1.copy(), w1, 1e-5, False, x1.copy())  # in place, one vector
    np.testing.assert_allclose(got, kernels.rmsnorm_ref(x1, w1, 1e-5, False), rtol=1e-5, atol=1e-5)
    q = rng.standard_normal((4, 32)).astype(np.float32)
    ang = np.arange(16) * 0.37
    cos = np.cos(np.concatenate([ang, ang])).astype(np.float32)
    sin = np.sin(np.concatenate([ang, ang])).astype(np.float32)
    np.testing.assert_allclose(kernels.rope(q.copy(), cos, sin), kernels.rope_ref(q, cos, sin),
                               rtol=1e-5, atol=1e-5)
    g = (3 * rng.standard_normal(256)).astype(np.float32)
    u = rng.standard_normal(256).astype(np.float32)
    for gelu in (False, True):
        np.testing.assert_allclose(kernels.gated(g.copy(), u, gelu), kernels.gated_ref(g, u, gelu),
                                   rtol=1e-5, atol=1e-5)
    big = np.array([-90.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 90.0], np.float32)  # exp's far ends
    for gelu in (False, True):
        np.testing.assert_allclose(kernels.gated(big.copy(), np.ones_like(big), gelu),
                                   kernels.gated_ref(big, np.ones_like(big), gelu),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("hq,hkv,rows", [(4, 1, 512), (9, 3, 37), (2, 2, 1)])
def test_window_attention_matches_its_reference(hq, hkv, rows):
    """A token over rows [r0, r1) of a window buffer [Hkv, cap, d]; query head j reads KV head
    j // (Hq / Hkv); rows outside the range must not count."""
    rng = np.random.default_rng(hq + rows)
    d, r0 = 32, 5
    kb = rng.standard_normal((hkv, r0 + rows + 7, d)).astype(np.float32)
    vb = rng.standard_normal(kb.shape).astype(np.float32)
    kb[:, :r0] = kb[:, r0 + rows:] = 50.0  # would dominate the softmax if read
    q = rng.standard_normal((hq, d)).astype(np.float32)
    kv = kernels.rows_kv(kb, vb)
    try:
        for threads in (1, 2):  # rows split over the threads, or not
            kernels.configure_threads(threads)
            out = kernels.attend_rows(kv, q, r0, r0 + rows, 0.25)
            ref = kernels.attend_rows_ref(q, kb[:, r0:r0 + rows], vb[:, r0:r0 + rows], 0.25)
            np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    finally:
        kernels.configure_threads(0)
    kb[:, r0 + rows - 1] = 50.0  # a row written after the view was made is read
    out = kernels.attend_rows(kv, q, r0, r0 + rows, 0.25)
    ref = kernels.attend_rows_ref(q, kb[:, r0:r0 + rows], vb[:, r0:r0 + rows], 0.25)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def _steps(path, n_prompt=300, n_steps=6, **kw):
    """Logits of `n_steps` teacher-forced decode steps, by the decoder and by the modules."""
    lm = load_model(path, device="CPU")
    st = settings(**kw)
    ids = list(np.random.default_rng(1).integers(3, lm.spec.vocab_size, n_prompt + n_steps))
    out = []
    for use in (True, False):
        s = Session(lm, st)
        assert (s.decoder is not None) == use or not use
        if not use:
            s.decoder = None
        s.prefill(ids[:n_prompt])
        out.append([s._forward([int(t)], None, sparse=True)[-1].numpy().copy()
                    for t in ids[n_prompt:]])
    return np.array(out[0]), np.array(out[1])


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_step_equals_the_modules(arch):
    """Float32 weights (no activation quantisation): the two ways agree to float rounding, for
    every family (Qwen2's biases, Qwen3's QK norm), through the sparse path past the budget."""
    mine, theirs = _steps(hf_model(arch))
    np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-4)


def test_decode_step_on_a_gguf_equals_the_modules():
    """A GGUF of F32 tensors: Q/K rows in llama.cpp's order (the permutation) and a tied head."""
    mine, theirs = _steps(gguf_model("llama", "F32"))
    np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-4)


def test_decode_step_of_a_gemma3_equals_the_modules(tmp_path):
    """Gemma 3: 1 + w norms, the norms after attention and MLP, QK norm, tanh-GELU, two RoPE
    tables, and sliding-window layers (a window of 16 tokens, so the ring drops rows)."""
    path = make_model(tmp_path / "gemma", "gemma3_text", layers=6, hidden=64, heads=4,
                      kv_heads=1, head_dim=16, sliding_window=16, seed=3)
    mine, theirs = _steps(path, n_prompt=40, n_steps=30)
    np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["gemma3", "q8_0 gguf"])
def test_decoder_rope_and_embedding_equal_the_modules(kind, tmp_path):
    """The decoder's RoPE rows (the rotary module asked for ROPE_ROWS positions at once) equal
    the module's tables for one position, on both sides of a batch's edge and for each of Gemma
    3's two tables; its embedding row (a quantised table read directly, Gemma's scale) equals
    the embedding module's."""
    if kind == "gemma3":
        path = make_model(tmp_path / "gemma", "gemma3_text", layers=6, hidden=64, heads=4,
                          kv_heads=1, head_dim=16, sliding_window=16, seed=3)
    else:
        path = gguf_model("llama", "Q8_0")
    lm = load_model(path, device="CPU")
    dec = decoder.build(lm)
    body = dec.body
    probe = torch.zeros((1, 1, 1))
    for pos in (0, 1, decoder.ROPE_ROWS - 1, decoder.ROPE_ROWS, 3 * decoder.ROPE_ROWS + 7, 5):
        want = position_embeddings(body, probe, torch.tensor([[pos]]))
        got = dec.rope(pos)
        for layer, (wc, ws) in enumerate(want):
            c, s = got[dec.rope_of[layer]]
            np.testing.assert_array_equal(c, wc.reshape(-1).numpy())
            np.testing.assert_array_equal(s, ws.reshape(-1).numpy())
    assert len(dec.rope(9)) == (2 if kind == "gemma3" else 1)
    for token in (0, 7, lm.spec.vocab_size - 1):
        want = body.embed_tokens(torch.tensor([[token]])).reshape(-1).numpy()
        np.testing.assert_array_equal(dec.embed(token), want)


def test_a_model_the_decoder_does_not_know_runs_its_modules():
    lm = load_model(hf_model("llama"), device="CPU")
    body = lm.model.model
    layer = body.layers[0]
    saved = layer.input_layernorm
    layer.input_layernorm = torch.nn.LayerNorm(saved.weight.shape[0])  # not an RMS norm
    try:
        assert decoder.build(lm) is None
        assert Session(lm, settings()).decoder is None
    finally:
        layer.input_layernorm = saved
    assert decoder.build(dataclasses.replace(lm, device=torch.device("meta"))) is None
