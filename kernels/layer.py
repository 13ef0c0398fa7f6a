"""The small per-layer operations of a one-token decode step: RMS norm, rotary embedding, the
gated MLP's activation, on float32 vectors, each beside a NumPy reference.

They are tiny (a few thousand floats): what they save is the per-call cost of a dozen torch ops,
not arithmetic. Sums of squares run in float32 like torch's; the activations follow torch's
formulas (SiLU x * sigmoid(x), GELU's tanh approximation).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from ._simd import F32, FASTMATH, LOG2E, exp2_neg

GELU_C = F32(math.sqrt(2.0 / math.pi))


@njit(cache=True)
def rmsnorm(x, w, eps, plus_one, out):
    """out [n] = x / sqrt(mean(x^2) + eps) * (w, or 1 + w with `plus_one`: Gemma).
    x may be out. Rows of a 2-D x [H, n] are normalised each (QK norm)."""
    x2 = x.reshape(-1, w.shape[0])
    o2 = out.reshape(-1, w.shape[0])
    n = w.shape[0]
    for r in range(x2.shape[0]):
        s = F32(0)
        for i in range(n):
            s += x2[r, i] * x2[r, i]
        inv = F32(1) / np.sqrt(s / F32(n) + F32(eps))
        for i in range(n):
            wi = F32(1) + w[i] if plus_one else w[i]
            o2[r, i] = x2[r, i] * inv * wi
    return out


@njit(cache=True)
def qk_rope(q, k, qw, kw, q_eps, k_eps, plus_one, cos, sin):
    """A decode step's queries and keys q [Hq, d], k [Hkv, d] in place: each head's RMS norm
    (QK norm: weights qw, kw [d]; none where they are empty), then RoPE with cos, sin [d]."""
    if qw.shape[0]:
        rmsnorm(q, qw, q_eps, plus_one, q)
        rmsnorm(k, kw, k_eps, plus_one, k)
    rope(q, cos, sin)
    rope(k, cos, sin)


@njit(cache=True)
def add_norm(h, y, yw, y_eps, w, eps, plus_one, out):
    """The residual stream h [n] += y [n] (first normed by yw [n] unless it is empty: Gemma's
    norms after attention and after the MLP), then out [n] = h normed by w (the next norm)."""
    if yw.shape[0]:
        rmsnorm(y, yw, y_eps, plus_one, y)
    for i in range(h.shape[0]):
        h[i] += y[i]
    rmsnorm(h, w, eps, plus_one, out)


def rmsnorm_ref(x: np.ndarray, w: np.ndarray, eps: float, plus_one: bool) -> np.ndarray:
    x = np.asarray(x, np.float64)
    r = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return r * (1.0 + w if plus_one else w)


@njit(cache=True)
def rope(x, cos, sin):
    """x [H, d] in place: x * cos + rotate_half(x) * sin, with cos, sin [d] (the halves
    repeated, as transformers builds them): rotate_half(x) = [-x2, x1]."""
    h = x.shape[1] // 2
    for r in range(x.shape[0]):
        for i in range(h):
            a, b = x[r, i], x[r, i + h]
            x[r, i] = a * cos[i] - b * sin[i]
            x[r, i + h] = b * cos[i + h] + a * sin[i + h]
    return x


def rope_ref(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    h = x.shape[-1] // 2
    rot = np.concatenate([-x[..., h:], x[..., :h]], -1)
    return x * cos + rot * sin


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)  # no zero-division check: vectorises
def gated(g, u, gelu):
    """g [n] = act(g) * u in place; act SiLU, or with `gelu` tanh-approximated GELU. Both through
    e = exp(-|z|) (exp2_neg: vectorises): sigmoid(z) = 1 / (1 + e), or e / (1 + e) for z < 0;
    tanh(z) = sign(z) (1 - e^2) / (1 + e^2)."""
    for i in range(g.shape[0]):
        a = g[i]
        if gelu:
            z = GELU_C * (a + F32(0.044715) * a * a * a)
            e = exp2_neg(F32(-2 * LOG2E) * abs(z))
            t = (F32(1) - e) / (F32(1) + e)
            a = F32(0.5) * a * (F32(1) + (t if z >= 0 else -t))
        else:
            e = exp2_neg(F32(-LOG2E) * abs(a))
            s = F32(1) / (F32(1) + e)
            a = a * (s if a >= 0 else e * s)
        g[i] = a * u[i]
    return g


def gated_ref(g: np.ndarray, u: np.ndarray, gelu: bool) -> np.ndarray:
    g = np.asarray(g, np.float64)
    if gelu:
        a = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
    else:
        a = g / (1 + np.exp(-g))
    return a * u
