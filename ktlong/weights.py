"""Weights on the CPU kept as stored: 16-bit (BF16/FP16) or GGUF-quantised linear layers and
embedding tables.

A one-token forward reads every weight once, so decode on the CPU is bound by weight traffic.
`compact` swaps a loaded model's linear layers (and its embedding table) for modules that keep the
16-bit bits and never hold a float32 copy:
- one input row (decode): the Numba GEMV widens the bits in registers (kernels/gemv.py);
- more rows (prefill): the weight is widened a block of rows at a time into a reused 4 MB scratch
  and multiplied by torch (a compute-bound GEMM, where the widening costs little).
Activations stay in the model's compute dtype (float32 on the CPU).
`QuantLinear` / `QuantEmbedding` do the same over a GGUF tensor's bytes in the memory-mapped file
(kernels/qlinear.py): decode reads the quantised bytes once; prefill either multiplies the blocks
by int8-rounded rows in the int8 GEMM (kernels/qmatmul.py: AMX, AVX512-VNNI, AVX-VNNI or
AVX2; `int8_prefill` says where) or dequantises tiles of rows for torch.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ktlong import kernels, quant

KINDS = {torch.bfloat16: kernels.KV_KINDS["BF16"], torch.float16: kernels.KV_KINDS["FP16"]}
SCRATCH_FLOATS = 1 << 20  # float32 elements of one widened block of weight rows (4 MB)

_local = threading.local()


def _scratch(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A buffer of >= n elements, one per dtype, reused by every GEMM of this thread (a fresh
    one would cost its page faults on every tile)."""
    name = f"buf_{dtype}".replace(".", "_")
    buf = getattr(_local, name, None)
    if buf is None or buf.numel() < n:
        buf = torch.empty(n, dtype=dtype)
        setattr(_local, name, buf)
    return buf


class HalfLinear(nn.Module):
    """`nn.Linear` with a 16-bit weight: bits [out, in] int16 (BF16 or FP16 by `kind`)."""

    mm_dtype = torch.float32  # prefill matmul precision (set_prefill_matmul)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, half: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.half, self.kind = half, KINDS[half]
        bits = weight if weight.dtype == torch.int16 else weight.to(half).view(torch.int16)
        self.register_buffer("bits", bits.contiguous())  # int16: .float() leaves it alone
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self._np = self.bits.numpy()  # [out, in] shares the buffer's memory

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"weight={str(self.half).removeprefix('torch.')}, bias={self.bias is not None}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        rows = x.numel() // self.in_features
        if rows == 1:
            xv = x.reshape(-1).to(torch.float32).contiguous().numpy()
            y = torch.from_numpy(kernels.gemv(self._np, xv, self.kind))  # [out] f32
        else:
            y = self._gemm(x.reshape(rows, self.in_features).to(torch.float32))
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] f32 -> [rows, out] f32, widening SCRATCH_FLOATS weights at a time."""
        n, k = self.out_features, self.in_features
        xm = x.to(self.mm_dtype)
        rb = max(1, min(n, SCRATCH_FLOATS // k))
        if rb == n or (self.half == self.mm_dtype == torch.bfloat16):  # no tiles, no output copy
            return F.linear(xm, _block(self, 0, n, 0, k)).float()
        y = torch.empty(x.shape[0], n)
        for r0 in range(0, n, rb):
            r1 = min(n, r0 + rb)
            y[:, r0:r1] = F.linear(xm, _block(self, r0, r1, 0, k))
        return y


class HalfEmbedding(nn.Module):
    """`nn.Embedding` over 16-bit rows, widened to `dtype` as they are looked up."""

    def __init__(self, bits: torch.Tensor, half: torch.dtype, dtype: torch.dtype,
                 scale: float = 1.0) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = bits.shape
        self.half, self.dtype, self.scale = half, dtype, scale
        self.register_buffer("bits", bits)  # [vocab, hidden] int16

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [...] -> [..., hidden]
        out = F.embedding(ids, self.bits).view(self.half).to(self.dtype)
        return out if self.scale == 1.0 else out.mul_(self.scale)


class QuantLinear(nn.Module):
    """`nn.Linear` over a GGUF tensor kept in its file's layout: raw [out, row_bytes] uint8.

    `qtype` is a ktlong.quant type name; `perm` [out] (optional) reorders the outputs (llama.cpp
    stores llama's Q/K rows interleaved per head: y = (W x)[perm] undoes it without a copy)."""

    mm_dtype = torch.float32  # prefill matmul precision (set_prefill_matmul)
    int8 = False  # prefill in the int8 GEMM (set_prefill_matmul)

    def __init__(self, raw: np.ndarray, qtype: str, in_features: int,
                 bias: torch.Tensor | None = None, perm: np.ndarray | None = None) -> None:
        super().__init__()
        self.qt = quant.TYPES[qtype]
        self.in_features, self.out_features = in_features, raw.shape[0]
        if raw.shape[1] != self.qt.row_bytes(in_features):
            raise ValueError(f"{qtype} rows of {in_features} take {self.qt.row_bytes(in_features)} "
                             f"bytes, got {raw.shape[1]}")
        self.raw = raw  # not a buffer: stays in the mapped file, outside state_dict and .to()
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.perm = None if perm is None else torch.as_tensor(perm, dtype=torch.long)
        self.block = self.qt.block  # a tile's columns start and end on these

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"weight={self.qt.name}, bias={self.bias is not None}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        rows = x.numel() // self.in_features
        if rows == 1:
            xv = x.reshape(-1).to(torch.float32).contiguous().numpy()
            y = torch.from_numpy(self._gemv(xv))  # [out] f32
        else:
            y = self._gemm(x.reshape(rows, self.in_features).to(torch.float32))
        if self.perm is not None:
            y = y[..., self.perm]
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _gemv(self, x: np.ndarray) -> np.ndarray:
        kind = _FLOAT_KINDS.get(self.qt.name)
        if kind is None:
            return kernels.qgemv(self.raw, self.qt.ggml, x)
        w = self.raw.view(np.float32 if kind == 0 else np.uint16)  # [out, in]
        return kernels.gemv(w, x, kind)

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] f32 -> [rows, out] f32: the int8 GEMM, or tiles of SCRATCH_FLOATS
        dequantised weights at a time."""
        if self.int8:
            return torch.from_numpy(kernels.qgemm(self.raw, self.qt.ggml, x.numpy(),
                                                  _rounded(x, self.qt.ggml)))
        n, k = self.out_features, self.in_features
        xm = x.to(self.mm_dtype)
        rb = max(1, min(n, SCRATCH_FLOATS // k))
        y = torch.empty(x.shape[0], n)
        for r0 in range(0, n, rb):
            r1 = min(n, r0 + rb)
            y[:, r0:r1] = F.linear(xm, _block(self, r0, r1, 0, k))
        return y

    def tile(self, r0: int, r1: int, c0: int, c1: int,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W[r0:r1, c0:c1] in float32 or bfloat16 (c0, c1 on block boundaries); rows in the
        file's order. A quantised tile lives in this thread's scratch until the next tile."""
        kind = _FLOAT_KINDS.get(self.qt.name)
        if kind is None and dtype == torch.bfloat16:  # dequantised straight to bf16 bits
            buf = _scratch((r1 - r0) * (c1 - c0), torch.bfloat16).view(torch.int16).numpy()
            t = kernels.dequant(self.raw, self.qt.ggml, self.in_features, r0, r1, c0, c1, True,
                                buf.view(np.uint16))
            return torch.from_numpy(t).view(torch.bfloat16)  # a view of the scratch
        if kind is None:  # a view of the scratch
            t = kernels.dequant(self.raw, self.qt.ggml, self.in_features, r0, r1, c0, c1,
                                out=_scratch((r1 - r0) * (c1 - c0)).numpy())
        else:
            w = self.raw.view(np.float32 if kind == 0 else np.uint16)[r0:r1, c0:c1]
            if kind == 1 and dtype == torch.bfloat16:  # a copy: the file is read-only
                return torch.from_numpy(np.array(w)).view(torch.bfloat16)
            t = np.array(w) if kind == 0 else _widen(w, kind)
        return torch.from_numpy(t).to(dtype)


_FLOAT_KINDS = {"F32": 0, "BF16": 1, "F16": 2}  # GGUF float types -> the 16/32-bit GEMV's kind


def _rounded(x: torch.Tensor, ggml: int) -> tuple[np.ndarray, ...]:
    """x [rows, in] rounded for the int8 GEMM of type `ggml`, reused while the same x meets
    another matrix of the same rounding: q, k, v and gate, up share their input. One entry a
    thread, keyed on x's memory and shape and a copy of its first and last rows (tensors made
    under inference mode keep no version counter); the entry holds x, so its memory is not
    reused meanwhile."""
    a = x.numpy()
    key = (a.ctypes.data, a.shape, kernels.qgemm_rounding(ggml))
    hit = getattr(_local, "xq", None)
    if hit is not None and hit[0] == key and np.array_equal(hit[1], a[[0, -1]]):
        return hit[2]
    xq = kernels.quantise_rows(a, ggml)
    _local.xq = (key, a[[0, -1]], xq, x)  # a[[0, -1]]: a copy
    return xq


def _widen(bits: np.ndarray, kind: int) -> np.ndarray:
    """BF16 (kind 1) or FP16 (kind 2) bits [..] uint16 -> float32."""
    if kind == 1:
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.view(np.float16).astype(np.float32)


class QuantEmbedding(nn.Module):
    """`nn.Embedding` over a GGUF table [vocab, row_bytes]: rows dequantised as looked up."""

    def __init__(self, table: QuantLinear, dtype: torch.dtype, scale: float = 1.0) -> None:
        super().__init__()
        self.table, self.dtype = table, dtype  # shares the head's module when tied
        self.scale = scale  # Gemma multiplies its embeddings by sqrt(hidden)
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [...] -> [..., hidden]
        t = self.table
        flat = ids.reshape(-1).numpy()
        if t.qt.name in _FLOAT_KINDS:
            kind = _FLOAT_KINDS[t.qt.name]
            rows = t.raw.view(np.float32 if kind == 0 else np.uint16)[flat]
            out = rows.astype(np.float32) if kind == 0 else _widen(rows, kind)
        else:
            out = kernels.dequant_rows(t.raw, t.qt.ggml, t.in_features, flat)
        out = torch.from_numpy(np.ascontiguousarray(out)).to(self.dtype)
        if self.scale != 1.0:
            out = out * self.scale
        return out.reshape(*ids.shape, self.embedding_dim)


def embed_scale(emb: nn.Module) -> float:
    """What a model's own embedding multiplies its rows by (Gemma: sqrt(hidden)), else 1."""
    return float(getattr(emb, "scalar_embed_scale", 1.0))


MLP_BLOCK_FLOATS = 1 << 20  # float32 elements of one [rows, block] slice of the MLP's inside


def _block(lin: nn.Module, r0: int, r1: int, c0: int, c1: int,
           dtype: torch.dtype | None = None) -> torch.Tensor:
    """lin's weight[r0:r1, c0:c1] in `dtype` (default lin.mm_dtype): a quantised tile is
    dequantised, a 16-bit one widened into the scratch (BF16 bits in BF16: a view, no copy)."""
    dtype = dtype or getattr(lin, "mm_dtype", torch.float32)
    if isinstance(lin, QuantLinear):
        return lin.tile(r0, r1, c0, c1, dtype)
    if isinstance(lin, HalfLinear):
        if lin.half == dtype:
            return lin.bits.view(lin.half)[r0:r1, c0:c1]
        w = _scratch((r1 - r0) * (c1 - c0))[: (r1 - r0) * (c1 - c0)].view(r1 - r0, c1 - c0)
        return w.copy_(lin.bits.view(lin.half)[r0:r1, c0:c1]).to(dtype)
    return lin.weight[r0:r1, c0:c1].to(dtype)


def _silu(g: torch.Tensor) -> torch.Tensor:
    return F.silu(g, inplace=True)


def _gelu_tanh(g: torch.Tensor) -> torch.Tensor:
    return F.gelu(g, approximate="tanh")


_GATE_ACTS = {"SiLU": _silu, "SiLUActivation": _silu,  # Llama, Qwen, Mistral
              "GELUTanh": _gelu_tanh, "PytorchGELUTanh": _gelu_tanh}  # Gemma


class GatedMLP(nn.Module):
    """A gated MLP (SiLU: Llama, Qwen, Mistral; tanh-GELU: Gemma) that never holds the whole
    [rows, intermediate] activations: with several rows it runs over slices of the intermediate
    dimension (gate and up rows, down columns), so a 1024-token prefill chunk holds slices of at
    most 4 MB, not four full [rows, intermediate] tensors. One row (decode) goes straight
    through."""

    mm_dtype = torch.float32  # prefill matmul precision (set_prefill_matmul)
    int8 = False  # all three projections in the int8 GEMM: whole [rows, intermediate] products

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.act = _GATE_ACTS[type(mlp.act_fn).__name__]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., hidden]
        rows = x.numel() // x.shape[-1]
        if rows == 1 or self.int8:
            g = self.act(self.gate_proj(x))  # [..., intermediate]
            return self.down_proj(g.mul_(self.up_proj(x)))
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
        dt = self.mm_dtype
        x2 = x.reshape(rows, -1).to(dt)  # [rows, hidden]
        hidden, inter = down.out_features, down.in_features
        # a slice's [rows, step] activations and its widened [hidden, step] down block both small;
        # a quantised down's columns are cut on its blocks
        blk = getattr(down, "block", 1)
        if dt == torch.float32:
            step = max(64, min(MLP_BLOCK_FLOATS // rows, SCRATCH_FLOATS // hidden))
        else:  # BF16 tiles have their own scratch, sized by the slice; a wide slice keeps
            step = max(64, MLP_BLOCK_FLOATS // rows) * 2  # the down product's inner size large
        step = max(blk, step // blk * blk)
        out = torch.zeros(rows, hidden)
        for j0 in range(0, inter, step):
            j1 = min(inter, j0 + step)
            g = self.act(F.linear(x2, _block(gate, j0, j1, 0, hidden, dt),
                                  _bias(gate, j0, j1, dt)))  # [rows, j]
            g.mul_(F.linear(x2, _block(up, j0, j1, 0, hidden, dt), _bias(up, j0, j1, dt)))
            if dt == torch.float32:
                out.addmm_(g, _block(down, 0, hidden, j0, j1, dt).t())  # [rows, hidden]
            else:  # a 16-bit product, summed over the slices in float32
                out += torch.mm(g, _block(down, 0, hidden, j0, j1, dt).t())
        if down.bias is not None:
            out += down.bias
        return out.to(x.dtype).reshape(x.shape)


def _bias(lin: nn.Module, j0: int, j1: int,
          dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    return None if lin.bias is None else lin.bias[j0:j1].to(dtype)


def gate_mlps_in_place(model: nn.Module) -> int:
    """Swap every gated MLP for `GatedMLP` (inference only); returns how many."""
    found = [
        (name, mod) for name, mod in model.named_modules()
        if all(hasattr(mod, a) for a in ("gate_proj", "up_proj", "down_proj"))
        and type(getattr(mod, "act_fn", None)).__name__ in _GATE_ACTS
    ]
    for name, mod in found:
        _replace(model, name, GatedMLP(mod))
    return len(found)


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attr, new)


def compact(model: nn.Module, half: torch.dtype, dtype: torch.dtype = torch.float32) -> None:
    """Keep `model`'s linear layers and input embedding in `half` (bf16 or fp16) bits; cast
    everything else to `dtype`. A tied output head shares the embedding's bits."""
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is emb.weight
    shared = emb.weight.detach().to(half).view(torch.int16)  # [vocab, hidden]
    model.set_input_embeddings(HalfEmbedding(shared, half, dtype, embed_scale(emb)))
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear) or (half == torch.bfloat16 and mod.in_features % 2):
            continue
        w = shared if mod is head and tied else mod.weight.detach()
        _replace(model, name, HalfLinear(w, None if mod.bias is None else mod.bias.detach(), half))
    model.to(dtype)  # norms, biases, rotary buffers; the int16 bits stay as they are


BF16_MIN_WIDTH = 512  # AUTO: narrower layers (tiny models, the demo) keep FP32 prefill matmuls
INT8_MIN_WIDTH = 1024  # AUTO: narrower quantised layers keep BF16 tiles (SmolLM2, Gemma 3 270M:
# docs/benchmarks.md, "Prefill on int8 products")


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether the CPU has BF16 dot products (AVX512-BF16 or AMX), where torch's BF16 matmul
    runs about twice its FP32 speed."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def bf16_prefill(width: int, mode: str) -> bool:
    """Whether a layer `width` inputs wide multiplies prefill rows in BF16 under `mode`."""
    return mode == "BF16" or (mode == "AUTO" and width >= BF16_MIN_WIDTH and cpu_has_bf16())


def int8_prefill(width: int, mode: str) -> bool:
    """Whether a quantised layer `width` inputs wide multiplies prefill rows in the int8 GEMM
    under `mode` (where the CPU has AMX, AVX512-VNNI, AVX-VNNI or AVX2)."""
    return kernels.INT8_GEMM and (mode == "INT8" or (mode == "AUTO" and width >= INT8_MIN_WIDTH))


def prefill_precision(width: int, mode: str) -> str:
    """What a quantised model `width` wide multiplies prefill rows in: INT8, BF16 or FP32."""
    if int8_prefill(width, mode):
        return "INT8"
    return "BF16" if bf16_prefill(width, "AUTO" if mode == "INT8" else mode) else "FP32"


def _int8_linear(mod: nn.Module, mode: str) -> bool:
    return (isinstance(mod, QuantLinear) and int8_prefill(mod.in_features, mode)
            and kernels.gemm_path(mod.qt.ggml, mod.in_features))


def set_prefill_matmul(model: nn.Module, mode: str) -> str:
    """Set the prefill matmul precision of `model`'s CPU weight modules: mode AUTO | INT8 |
    BF16 | FP32 (the `prefill_matmul` setting; INT8 falls back to AUTO's choice where the CPU
    or the type has no int8 GEMM). Returns "INT8" if any module multiplies in the int8 GEMM,
    else "BF16" if any in BF16, else "FP32"."""
    held = "FP32"
    tile_mode = "AUTO" if mode == "INT8" else mode
    for mod in model.modules():
        if isinstance(mod, (HalfLinear, QuantLinear)):
            width = mod.in_features
        elif isinstance(mod, GatedMLP):
            width = mod.down_proj.out_features
        else:
            continue
        bf16 = bf16_prefill(width, tile_mode)
        mod.mm_dtype = torch.bfloat16 if bf16 else torch.float32
        if isinstance(mod, GatedMLP):
            mod.int8 = all(_int8_linear(p, mode) for p in (mod.gate_proj, mod.up_proj,
                                                          mod.down_proj))
        elif isinstance(mod, QuantLinear):
            mod.int8 = _int8_linear(mod, mode)
        if getattr(mod, "int8", False):
            held = "INT8"
        elif bf16 and held != "INT8":
            held = "BF16"
    return held
