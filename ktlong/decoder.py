"""The one-token forward ktlong runs itself on the CPU: no transformers module calls in decode.

On a small model a decode step's time is per-call overhead, not bytes: transformers' layer runs a
few dozen torch ops and module calls per token (SmolLM2-135M: 30 layers). Here a step is, per
layer, the norm, the projections through ktlong's GEMVs (quantised or 16-bit, straight on the
weights' bytes), QK norm and RoPE, attention through the session's router (the KV store, or the
sliding-window ring), the output projection, and the gated MLP, on float32 NumPy vectors, with
the small operations in kernels/layer.py. Prefill keeps transformers' classes (there the work is
in the matmuls).

One plan per architecture family, read off the loaded modules: llama/qwen2/qwen3/mistral (norm,
attention, residual, norm, MLP, residual; Qwen2 biases; Qwen3 QK norm) and gemma3 (adds QK norm,
a norm after attention and after the MLP, 1 + w norms, tanh-GELU). `build` returns None for a
model it does not know (its modules then run as they are).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ktlong import kernels
from ktlong.weights import (
    _FLOAT_KINDS,
    GatedMLP,
    HalfLinear,
    QuantEmbedding,
    QuantLinear,
    _gelu_tanh,
)

Vec = np.ndarray  # float32 [n]
Linear = Callable[[Vec], Vec]
Pair = Callable[[Vec], tuple[Vec, Vec]]  # x -> two linears of x (q and k, gate and up)

# RMS norm classes: whether the weight enters as 1 + w (Gemma) or as it is
_NORMS = {"LlamaRMSNorm": False, "Qwen2RMSNorm": False, "Qwen3RMSNorm": False,
          "MistralRMSNorm": False, "Gemma3RMSNorm": True}


@dataclass(frozen=True)
class Norm:
    w: Vec  # [n] float32
    eps: float
    plus_one: bool

    def __call__(self, x: Vec, out: Vec | None = None) -> Vec:
        return kernels.rmsnorm(x, self.w, self.eps, self.plus_one, x if out is None else out)


def _norm(mod: nn.Module | None) -> Norm | None:
    if mod is None or type(mod).__name__ not in _NORMS:
        return None
    eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
    w = np.ascontiguousarray(mod.weight.detach().float().numpy())
    return Norm(w, float(eps), _NORMS[type(mod).__name__])


def _perm_bias(mod: nn.Module) -> tuple[np.ndarray | None, Vec | None]:
    """A linear's output row order (a GGUF q or k: transformers' order) and float32 bias."""
    bias = getattr(mod, "bias", None)
    b = None if bias is None else np.ascontiguousarray(bias.detach().float().numpy())
    perm = mod.perm if isinstance(mod, QuantLinear) else None
    return (None if perm is None else perm.numpy()), b


def _finish(y: Vec, perm: np.ndarray | None, b: Vec | None) -> Vec:
    if perm is not None:
        y = y[perm]
    if b is not None:
        y += b
    return y


def _linear(mod: nn.Module) -> Linear | None:
    """x [in] f32 -> y [out] f32 through ktlong's GEMV on the module's own bytes."""
    if isinstance(mod, QuantLinear):
        kind = _FLOAT_KINDS.get(mod.qt.name)
        if kind is None:
            raw, qtype = mod.raw, mod.qt.ggml

            def gemv(x: Vec) -> Vec:
                return kernels.qgemv(raw, qtype, x)
        else:
            w = mod.raw.view(np.float32 if kind == 0 else np.uint16)

            def gemv(x: Vec) -> Vec:
                return kernels.gemv(w, x, kind)
    elif isinstance(mod, HalfLinear):
        w16, kind16 = mod._np, mod.kind

        def gemv(x: Vec) -> Vec:
            return kernels.gemv(w16, x, kind16)
    elif type(mod) is nn.Linear and mod.weight.dtype == torch.float32 \
            and mod.weight.device.type == "cpu":
        w32 = mod.weight.detach().numpy()

        def gemv(x: Vec) -> Vec:
            return kernels.gemv(w32, x, 0)
    else:
        return None
    perm, b = _perm_bias(mod)
    if perm is None and b is None:
        return gemv

    def full(x: Vec) -> Vec:
        return _finish(gemv(x), perm, b)
    return full


def _pair(a: nn.Module, b: nn.Module, fa: Linear, fb: Linear) -> Pair:
    """x -> (a x, b x) for two linears of one input: one `qgemv2` call where both are quantised
    in one type, else their two GEMVs."""
    if not (isinstance(a, QuantLinear) and isinstance(b, QuantLinear)
            and a.qt.name == b.qt.name and a.qt.name not in _FLOAT_KINDS):
        def two(x: Vec) -> tuple[Vec, Vec]:
            return fa(x), fb(x)
        return two
    ra, rb, qtype = a.raw, b.raw, a.qt.ggml
    (pa, ba), (pb, bb) = _perm_bias(a), _perm_bias(b)

    def both(x: Vec) -> tuple[Vec, Vec]:
        ya, yb = kernels.qgemv2(ra, rb, qtype, x)
        return _finish(ya, pa, ba), _finish(yb, pb, bb)
    return both


_NO_WEIGHT = np.zeros(0, np.float32)  # a norm the layer does not have (kernels skip it)


def _add_args(y_norm: Norm | None, norm: Norm) -> tuple[Vec, float, Vec, float, bool]:
    """kernels.add_norm's arguments between h, y and out: h += y normed by y_norm (if any),
    then out = norm(h)."""
    yw, y_eps = (_NO_WEIGHT, 0.0) if y_norm is None else (y_norm.w, y_norm.eps)
    return yw, y_eps, norm.w, norm.eps, norm.plus_one


@dataclass(frozen=True)
class LayerPlan:
    index: int
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    attn_norm: Norm
    qk: Pair  # x -> q, k
    v: Linear
    o: Linear
    qk_norm: tuple[Vec, Vec, float, float]  # QK norm over each head (Qwen3, Gemma 3): q's and
    # k's weights [d] (empty: none) and eps, as kernels.qk_rope takes them
    attn_out_norm: Norm | None  # on the attention's output, before the residual (Gemma 3)
    mlp_norm: Norm
    gate_up: Pair  # x -> gate, up
    down: Linear
    gelu: bool
    mlp_out_norm: Norm | None  # on the MLP's output (Gemma 3)


def _layer(i: int, layer: nn.Module) -> LayerPlan | None:
    attn, mlp = layer.self_attn, layer.mlp
    if not isinstance(mlp, GatedMLP):
        return None
    gemma = hasattr(layer, "pre_feedforward_layernorm")
    cfg = attn.config
    parts = dict(
        attn_norm=_norm(layer.input_layernorm),
        q=_linear(attn.q_proj), k=_linear(attn.k_proj), v=_linear(attn.v_proj),
        o=_linear(attn.o_proj),
        mlp_norm=_norm(layer.pre_feedforward_layernorm if gemma
                       else layer.post_attention_layernorm),
        gate=_linear(mlp.gate_proj), up=_linear(mlp.up_proj), down=_linear(mlp.down_proj),
    )
    if any(v is None for v in parts.values()):
        return None
    extra = dict(q_norm=_norm(getattr(attn, "q_norm", None)),
                 k_norm=_norm(getattr(attn, "k_norm", None)),
                 attn_out_norm=_norm(layer.post_attention_layernorm) if gemma else None,
                 mlp_out_norm=_norm(layer.post_feedforward_layernorm) if gemma else None)
    for name in ("q_norm", "k_norm"):  # present but of a kind this file does not know
        if getattr(attn, name, None) is not None and extra[name] is None:
            return None
    if gemma and None in (extra["attn_out_norm"], extra["mlp_out_norm"]):
        return None
    norms = [n for n in (parts["attn_norm"], parts["mlp_norm"], *extra.values()) if n is not None]
    if len({n.plus_one for n in norms}) > 1:  # the fused kernels take one kind
        return None
    qn, kn = extra.pop("q_norm"), extra.pop("k_norm")
    qk_norm = (_NO_WEIGHT, _NO_WEIGHT, 0.0, 0.0) if qn is None or kn is None else \
        (qn.w, kn.w, qn.eps, kn.eps)
    qk = _pair(attn.q_proj, attn.k_proj, parts.pop("q"), parts.pop("k"))
    gate_up = _pair(mlp.gate_proj, mlp.up_proj, parts.pop("gate"), parts.pop("up"))
    return LayerPlan(index=i, heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                     head_dim=attn.head_dim, scale=float(attn.scaling), gelu=mlp.act is _gelu_tanh,
                     qk=qk, gate_up=gate_up, qk_norm=qk_norm, **parts, **extra)


ROPE_ROWS = 256  # positions whose RoPE tables one call of the model's rotary module computes
_LENGTH_ROPE = {"dynamic", "longrope"}  # RoPE types whose tables depend on the longest position
# asked for: a position at a time


class Decoder:
    """Runs one token through a CPU model; `step` returns logits [1, vocab] float32."""

    def __init__(self, lm: Any, layers: list[LayerPlan], norm: Norm, head: Linear) -> None:
        self.lm, self.layers, self.norm, self.head = lm, layers, norm, head
        self.body = lm.model.model
        self.softcap = getattr(lm.model.config, "final_logit_softcapping", None)
        kinds = getattr(self.body.rotary_emb, "rope_type", "default")
        kinds = set(kinds.values()) if isinstance(kinds, dict) else {kinds}
        self._rope_rows = 1 if kinds & _LENGTH_ROPE else ROPE_ROWS
        self._rope_at = -1  # first position of the tables in _rope
        self._rope: list[tuple[np.ndarray, np.ndarray]] = []  # per table: cos, sin [rows, d]
        self.rope_of: list[int] = []  # layer -> its table in _rope (Gemma 3: one per layer type)
        # per layer, kernels.add_norm's norm arguments after attention and after the MLP: the
        # norm of what is added (or none), then the next norm (the MLP's; the next layer's, or
        # the final norm)
        nexts = [p.attn_norm for p in layers[1:]] + [norm]
        self._adds = [(_add_args(p.attn_out_norm, p.mlp_norm), _add_args(p.mlp_out_norm, nxt))
                      for p, nxt in zip(layers, nexts, strict=True)]

    def embed(self, token: int) -> Vec:
        """The token's embedding row [hidden] float32: straight from a quantised table's bytes,
        else through the model's own module."""
        emb = self.body.embed_tokens
        if (isinstance(emb, QuantEmbedding) and emb.dtype == torch.float32
                and emb.table.qt.name not in _FLOAT_KINDS):
            t = emb.table
            h = kernels.dequant_rows(t.raw, t.qt.ggml, t.in_features, np.array([token]))[0]
            if emb.scale != 1.0:
                h *= np.float32(emb.scale)
            return h
        h_t = emb(torch.tensor([[token]]))  # [1, 1, hidden]
        return np.array(h_t.reshape(-1).float().numpy(), np.float32)

    def rope(self, pos: int) -> list[tuple[Vec, Vec]]:
        """Each table's RoPE cos, sin [d] at `pos` (layer i's is `rope_of[i]`), from the model's
        rotary module, which is asked for ROPE_ROWS positions at a time (its per-call cost
        exceeds a layer's on a small model)."""
        from ktlong.engine import position_embeddings

        r = pos % self._rope_rows
        if self._rope_at != pos - r:
            self._rope_at = pos - r
            probe = torch.zeros((1, 1, 1), dtype=self.lm.model.dtype)  # the tables' dtype
            ids = torch.arange(pos - r, pos - r + self._rope_rows)[None]
            index: dict[int, int] = {}  # id of a (cos, sin) pair -> its table
            self._rope, self.rope_of = [], []
            for cs in position_embeddings(self.body, probe, ids):
                if id(cs) not in index:
                    index[id(cs)] = len(self._rope)
                    self._rope.append((cs[0][0].float().numpy(), cs[1][0].float().numpy()))
                self.rope_of.append(index[id(cs)])
        return [(c[r], s[r]) for c, s in self._rope]

    def step(self, token: int, pos: int, router: Any, store: Any) -> torch.Tensor:
        h = self.embed(token)  # [hidden] the residual stream
        x = np.empty_like(h)  # [hidden] h normed: the next GEMVs' input
        rope = self.rope(pos)
        plus_one = self.norm.plus_one
        self.layers[0].attn_norm(h, x)
        for p, (after_attn, after_mlp) in zip(self.layers, self._adds, strict=True):
            cos, sin = rope[self.rope_of[p.index]]
            q, k = p.qk(x)
            q, k = q.reshape(p.heads, p.head_dim), k.reshape(p.kv_heads, p.head_dim)
            v = p.v(x).reshape(p.kv_heads, p.head_dim)
            kernels.qk_rope(q, k, *p.qk_norm, plus_one, cos, sin)
            a = router.attend_one(p.index, q, k, v, p.scale)  # [Hq, d]
            o = p.o(np.ascontiguousarray(a, np.float32).reshape(-1))
            kernels.add_norm(h, o, *after_attn, x)
            g, u = p.gate_up(x)
            kernels.gated(g, u, p.gelu)
            kernels.add_norm(h, p.down(g), *after_mlp, x)
            store.check_resident()
        logits = self.head(x)
        if self.softcap:  # in place: the vector is the vocabulary's size
            logits *= 1.0 / self.softcap
            np.tanh(logits, out=logits)
            logits *= self.softcap
        return torch.from_numpy(logits)[None]


def build(lm: Any) -> Decoder | None:
    """The decoder for a CPU model whose modules this file knows, else None."""
    if lm.device.type != "cpu":
        return None
    body = getattr(lm.model, "model", None)
    head = getattr(lm.model, "lm_head", None)
    if body is None or head is None or not hasattr(body, "layers"):
        return None
    layers = [_layer(i, layer) for i, layer in enumerate(body.layers)]
    norm, head_fn = _norm(getattr(body, "norm", None)), _linear(head)
    if any(p is None for p in layers) or norm is None or head_fn is None:
        return None
    if any(p.attn_norm.plus_one != norm.plus_one for p in layers if p is not None):
        return None
    return Decoder(lm, layers, norm, head_fn)
