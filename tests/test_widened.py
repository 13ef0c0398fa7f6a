"""A GGUF type the kernels do not read (IQ4_NL here) is widened to BF16 on load, with a warning
that names its cost, and works on every path: prefill chunks, decode, FP32 and BF16 matmuls."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from ktlong.engine import Sampling, Session
from ktlong.model import load_model
from ktlong.weights import GatedMLP, QuantLinear

from .models import hf_model, settings
from .test_engine import _prompt, _stock

_KVALUES = np.array(gguf.quants.IQ4_NL.kvalues, np.float32)  # the 16 levels of a nibble


def _iq4_nl(x: np.ndarray) -> np.ndarray:
    """x [rows, k] -> IQ4_NL blocks [rows, k / 32 * 18] (d f16 | 16 bytes of level indices)."""
    blocks = x.reshape(-1, 32)
    d = (np.abs(blocks).max(-1) / 127).astype(np.float16)  # [n]
    scaled = blocks / np.maximum(d.astype(np.float32), 1e-12)[:, None]
    idx = np.abs(scaled[..., None] - _KVALUES).argmin(-1).astype(np.uint8)  # [n, 32]
    qs = idx[:, :16] | (idx[:, 16:] << 4)
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), qs], 1)
    return out.reshape(x.shape[0], -1)


def _write(folder: Path, out: Path) -> Path:
    """The tiny llama as a GGUF whose MLP down projections are IQ4_NL (the rest F32)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    from ktlong.tinymodel import _permute_qk, gguf_header

    cfg = AutoConfig.from_pretrained(folder)
    arch = gguf.MODEL_ARCH.LLAMA
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    gguf_header(w, cfg, AutoTokenizer.from_pretrained(folder))
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    state = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(f))
    for hf_name, t in state.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        t = t.float().numpy()
        if hf_name.endswith("q_proj.weight"):
            t = _permute_qk(t, cfg.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            t = _permute_qk(t, cfg.num_key_value_heads)
        if hf_name.endswith("down_proj.weight"):
            q = _iq4_nl(t)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_a_widened_type_chats_like_transformers_on_the_same_file(tmp_path):
    folder = hf_model("llama")
    path = _write(folder, tmp_path / "iq4nl.gguf")
    lm = load_model(path, device="CPU")
    downs = [m.down_proj for m in lm.model.modules() if isinstance(m, GatedMLP)]
    assert downs and all(isinstance(d, QuantLinear) and d.qt.name == "BF16" for d in downs)
    assert len(lm.warnings) == len(downs)
    assert all("IQ4_NL, which ktlong widens to BF16 (+" in w for w in lm.warnings)
    ids = _prompt(lm.tokenizer)[:300]
    s = Session(lm, settings(attention="DENSE"))
    s.prefill(ids)  # chunks of 256 rows and the 44 left: tiles of the widened weight
    got = [st.token_id for st in s.generate(Sampling(max_new_tokens=12))]  # the GEMV
    stock = _stock(path)
    with torch.no_grad():
        ref = stock.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    # transformers holds the dequantised weight in float32, ktlong its BF16 rounding
    agree = sum(a == b for a, b in zip(got, ref[0, len(ids):].tolist(), strict=True))
    assert agree >= 10, (got, ref[0, len(ids):].tolist())


def test_gated_mlp_mixes_a_bf16_down_projection_into_fp32_prefill(tmp_path):
    """prefill_matmul AUTO sets each module by its own width: a wide down projection may tile in
    BF16 while its MLP (narrower output) multiplies in FP32. The down tile must come in the
    MLP's dtype (it used to come in BF16: 'self and mat2 must have the same dtype')."""
    path = _write(hf_model("llama"), tmp_path / "iq4nl.gguf")
    lm = load_model(path, device="CPU")
    mlp = next(m for m in lm.model.modules() if isinstance(m, GatedMLP))
    x = torch.randn(40, mlp.gate_proj.in_features)
    want = mlp(x)
    mlp.down_proj.mm_dtype = torch.bfloat16  # as AUTO leaves a >= 1024-wide down on a BF16 CPU
    torch.testing.assert_close(mlp(x), want)
