"""Load a GGUF model with its tensors left in the memory-mapped file.

transformers' own GGUF loader dequantises every tensor to full precision (a 4.9 GB Q4_K_M 8B
becomes ~16 GB of BF16 and peaks higher while loading). Here the model is built empty (on the
meta device) from the file's config, then:
- each linear layer becomes a `QuantLinear` over its tensor's bytes in the mapped file;
- the embedding table becomes a `QuantEmbedding` (rows dequantised as looked up); a model without
  `output.weight` uses the same table for its output head;
- norms and biases (small, F32) are copied; RoPE frequencies are rebuilt from the config.
Types the kernels do not read (ktlong.quant.TYPES) are widened to BF16, with a warning that says
what that costs. llama.cpp stores llama/mistral Q and K rows interleaved per head: the modules
reorder their outputs instead of copying the weights.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ktlong import quant
from ktlong.errors import KtlongError

_ARCH = {"llama": "LLAMA", "mistral": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3",
         "gemma3_text": "GEMMA3"}
NORM_SHIFT = {"gemma3_text": 1.0}  # llama.cpp stores Gemma's RMSNorm weights as 1 + w


def qk_order(rows: int, n_head: int) -> np.ndarray:
    """perm [rows] with y_hf = y_file[perm] for a Q or K projection llama.cpp permuted: file row
    h*d + 2i + s holds HF row h*d + s*d/2 + i."""
    d = rows // n_head
    h, s, i = np.meshgrid(np.arange(n_head), np.arange(2), np.arange(d // 2), indexing="ij")
    return (h * d + 2 * i + s).reshape(-1)  # indexed by HF row h*d + s*d/2 + i


def _raw(t: Any) -> tuple[np.ndarray, str, int]:
    """A reader tensor -> (bytes [rows, row_bytes] uint8 view of the mapping, type name, k)."""
    k = int(t.shape[0])  # ggml order: ne0 is the row length
    rows = int(t.n_elements) // k
    data = np.asarray(t.data)
    return data.view(np.uint8).reshape(rows, -1), t.tensor_type.name, k


def load_quantised(path: str, config: Any, dtype: Any, attn: str) -> tuple[Any, list[str]]:
    """Build a transformers model around the GGUF file's tensors; returns (model, warnings)."""
    import gguf
    import torch
    from torch import nn
    from transformers import AutoModelForCausalLM

    from ktlong.spec import open_gguf
    from ktlong.weights import QuantEmbedding, QuantLinear, _replace, embed_scale

    reader = open_gguf(path)  # a truncated or damaged file: one clear line
    tensors = {t.name: t for t in reader.tensors}
    arch = gguf.MODEL_ARCH[_ARCH[config.model_type]]
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    permute = config.model_type in ("llama", "mistral") and _ARCH[config.model_type] == "LLAMA"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    warnings: list[str] = []

    def find(hf_name: str) -> Any:
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        return tensors.get(name) if name else None

    def linear(t: Any, hf_name: str, bias: Any = None) -> nn.Module:
        raw, qtype, k = _raw(t)
        perm = None
        if permute and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = (config.num_attention_heads if "q_proj" in hf_name
                     else config.num_key_value_heads)
            perm = qk_order(raw.shape[0], heads)
        if qtype not in quant.TYPES:
            warnings.append(f"{t.name} is {qtype}, which ktlong widens to BF16 "
                            f"(+{(2 * int(t.n_elements) - int(t.n_bytes)) / 1e6:.0f} MB)")
            wide = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)  # [rows, k] f32
            raw, qtype = _bf16(wide.reshape(-1, k)), "BF16"
        return QuantLinear(raw, qtype, k, bias, perm)

    emb_t = find("model.embed_tokens.weight")
    if emb_t is None:
        raise KtlongError(f"{path} has no token embedding table (token_embd.weight)")
    table = linear(emb_t, "model.embed_tokens.weight")
    scale = embed_scale(model.get_input_embeddings())  # Gemma: sqrt(hidden)
    model.set_input_embeddings(QuantEmbedding(table, dtype, scale))
    head_t = find("lm_head.weight")
    model.lm_head = table if head_t is None else linear(head_t, "lm_head.weight")
    for name, mod in list(model.named_modules()):
        if isinstance(mod, nn.Linear) and name != "lm_head":
            t = find(f"{name}.weight")
            if t is None:
                raise KtlongError(f"{path} has no tensor for {name}",
                                  hint="the file may be for another architecture or incomplete")
            b = find(f"{name}.bias") if mod.bias is not None else None
            bias = None if b is None else torch.from_numpy(_float(b))
            _replace(model, name, linear(t, f"{name}.weight", bias))
    for name, p in list(model.named_parameters()):
        if p.device.type != "meta":
            continue
        t = find(name)
        if t is None:
            raise KtlongError(f"{path} has no tensor for {name}",
                              hint="the file may be for another architecture or incomplete")
        mod_name, _, attr = name.rpartition(".")
        value = torch.from_numpy(_float(t).reshape(p.shape)).to(dtype)
        if name.endswith("norm.weight"):
            value -= NORM_SHIFT.get(config.model_type, 0.0)
        setattr(model.get_submodule(mod_name), attr, nn.Parameter(value, requires_grad=False))
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=config)  # its buffers were made on meta
    left = [n for n, b in [*model.named_parameters(), *model.named_buffers()]
            if b.device.type == "meta"]
    if left:
        raise KtlongError(f"{path}: no value for {left[0]} after loading")
    model._ktlong_mapping = reader.data  # the file stays mapped while the model lives
    return model, warnings


def _float(t: Any) -> np.ndarray:
    """A small tensor (norm, bias) as a float32 copy."""
    import gguf

    data = np.asarray(t.data)
    if t.tensor_type.name in ("F32", "F16"):
        return data.astype(np.float32).reshape(-1)
    return gguf.quants.dequantize(data, t.tensor_type).astype(np.float32).reshape(-1)


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 [rows, k] -> BF16 bits as bytes [rows, 2k] (round to nearest even)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16).view(np.uint8)
