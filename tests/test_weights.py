"""16-bit CPU weights: the GEMV kernel against NumPy, the modules against torch, and a BF16
checkpoint through the engine against transformers' float32 forward of the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from ktlong import kernels, weights
from ktlong.engine import Sampling, Session
from ktlong.model import load_model
from ktlong.tinymodel import filler_text
from ktlong.weights import HalfEmbedding, HalfLinear

from .models import ARCHS, gguf_model, hf_model, settings
from .test_engine import _stock


@pytest.mark.parametrize("kind", [0, 1, 2])
@pytest.mark.parametrize("n,k", [(1, 2), (5, 6), (7, 34), (33, 64), (130, 1000), (512, 2048)])
def test_gemv_equals_reference(kind, n, k):
    rng = np.random.default_rng(n * 1000 + k)
    w = kernels.f32_to_kv(rng.standard_normal((n, k)).astype(np.float32), kind)  # [N, K]
    x = rng.standard_normal(k).astype(np.float32)
    got, ref = kernels.gemv(w, x, kind), kernels.gemv_ref(w, x, kind)
    assert got.shape == (n,) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.sqrt(k))


def test_gemv_rejects_bad_shapes():
    w = np.zeros((4, 5), np.uint16)
    with pytest.raises(ValueError, match="even"):
        kernels.gemv(w, np.zeros(5, np.float32), 1)
    with pytest.raises(ValueError, match="x must be"):
        kernels.gemv(np.zeros((4, 6), np.uint16), np.zeros(5, np.float32), 1)
    with pytest.raises(ValueError, match="4-byte"):
        kernels.gemv(w, np.zeros(5, np.float32), 0)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_half_linear_equals_linear_over_the_same_16_bit_weights(half, rows, bias, monkeypatch):
    monkeypatch.setattr(weights, "SCRATCH_FLOATS", 1000)  # several widened blocks per GEMM
    torch.manual_seed(0)
    ref = nn.Linear(96, 70, bias=bias)
    mod = HalfLinear(ref.weight.detach(), ref.bias.detach() if bias else None, half)
    ref.weight.data = ref.weight.data.to(half).float()  # the values the module holds
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        got, want = mod(x.unsqueeze(0)), ref(x).unsqueeze(0)  # [1, rows, 70]
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert mod.bits.dtype == torch.int16 and mod.bits.shape == (70, 96)


def _ids(lm, n):
    ids = lm.tokenizer(filler_text(n, seed=3))["input_ids"]
    return ids[:n]


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_checkpoint_keeps_bf16_weights_and_equals_transformers(arch):
    path = hf_model(arch, dtype="bfloat16")
    lm = load_model(path, device="CPU")  # float32 activations, the checkpoint's BF16 weights
    assert lm.weight_type == "BF16"
    body = lm.model
    linears = [m for m in body.modules() if isinstance(m, nn.Linear)]
    assert not linears, "every linear layer keeps 16-bit weights"
    assert isinstance(body.get_input_embeddings(), HalfEmbedding)
    assert all(p.dtype == torch.float32 for p in body.parameters())  # norms, biases: float32

    ids = _ids(lm, 600)
    s = Session(lm, settings(attention="DENSE"))
    logits = s.prefill(ids, all_logits=True)  # chunks of 256 rows: the widened GEMM
    got = [st.token_id for st in s.generate(Sampling(max_new_tokens=24))]  # one row: the GEMV
    stock = _stock(path).float()  # transformers, float32 over the same values
    with torch.no_grad():
        ref_logits = stock(torch.tensor([ids])).logits[0]
        ref = stock.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):]
    assert (logits - ref_logits).abs().max().item() < 1e-4
    assert got == ref.tolist()


def test_16_bit_weights_take_half_the_memory_and_a_tied_head_shares_them():
    def nbytes(lm):
        return sum(t.numel() * t.element_size()
                   for t in (*lm.model.parameters(), *lm.model.buffers()) if t.dim() > 1)

    path = hf_model("llama", dtype="bfloat16", tie_embeddings=True, hidden=128)
    half = load_model(path, device="CPU")
    full = load_model(path, device="CPU", weight_type="FP32")
    assert full.weight_type == "FP32" and isinstance(full.model.lm_head, nn.Linear)
    assert half.model.lm_head.bits.data_ptr() == half.model.get_input_embeddings().bits.data_ptr()
    assert nbytes(half) <= 0.51 * nbytes(full)
    ids = _ids(half, 300)
    a = Session(half, settings(attention="DENSE")).prefill(ids)
    b = Session(full, settings(attention="DENSE")).prefill(ids)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # FP32 widening is exact


def test_weight_type_converts_an_fp32_checkpoint():
    path = hf_model("llama")  # float32 weights
    assert load_model(path, device="CPU").weight_type == "FP32"  # AUTO keeps FP32
    for name, dt in (("BF16", torch.bfloat16), ("FP16", torch.float16)):
        lm = load_model(path, device="CPU", weight_type=name)
        ref = load_model(path, device="CPU", dtype="float32", weight_type="FP32")
        q = lm.model.model.layers[0].self_attn.q_proj
        q_ref = ref.model.model.layers[0].self_attn.q_proj
        assert lm.weight_type == name and q.half == dt
        assert torch.equal(q.bits.view(dt), q_ref.weight.to(dt))  # rounded once, nearest


@pytest.mark.parametrize("tensor_type", ["F32", "F16", "Q8_0"])
def test_gguf_weights_stay_in_the_file_unless_a_weight_type_is_asked_for(tensor_type):
    from ktlong.weights import QuantLinear

    path = gguf_model("llama", tensor_type)
    lm = load_model(path, device="CPU")
    assert lm.weight_type == f"GGUF {tensor_type}"
    assert isinstance(lm.model.lm_head, QuantLinear)
    wide = load_model(path, device="CPU", weight_type="BF16")  # transformers widens, as asked
    assert wide.weight_type == "BF16" and isinstance(wide.model.lm_head, HalfLinear)


@pytest.mark.parametrize("half", [None, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_gated_mlp_in_slices_equals_the_stock_mlp(half, rows, monkeypatch):
    from transformers.models.llama.modeling_llama import LlamaMLP

    from ktlong.tinymodel import make_config

    monkeypatch.setattr(weights, "MLP_BLOCK_FLOATS", 3000)  # slices of 64 intermediate columns
    torch.manual_seed(1)
    cfg = make_config("llama", hidden=48, intermediate=200)
    cfg.mlp_bias = True
    stock = LlamaMLP(cfg).eval()
    if half is not None:
        for name in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(stock, name)
            lin.weight.data = lin.weight.data.to(half).float()
    mlp = nn.Sequential(stock)
    assert weights.gate_mlps_in_place(mlp) == 1
    if half is not None:
        for name in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(mlp[0], name)
            setattr(mlp[0], name, HalfLinear(lin.weight.detach(), lin.bias.detach(), half))
    x = torch.randn(1, rows, 48)
    with torch.inference_mode():
        torch.testing.assert_close(mlp(x), stock(x), rtol=1e-5, atol=1e-5)


def test_pickle_checkpoint_takes_its_16_bit_type_from_config(tmp_path):
    import shutil

    from safetensors.torch import load_file

    src = hf_model("llama", dtype="bfloat16")
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    state = {}
    for f in src.glob("*.safetensors"):
        state.update(load_file(f))
    torch.save(state, tmp_path / "pytorch_model.bin")  # no header to read the dtype from
    lm = load_model(tmp_path, device="CPU", allow_pickle=True)
    assert lm.weight_type == "BF16"
    assert isinstance(lm.model.lm_head, HalfLinear)


def _bf16_close(got: torch.Tensor, want: torch.Tensor, rel: float = 0.02) -> None:
    """BF16 products: within `rel` of the largest output (rounding of x, W and the result)."""
    assert got.shape == want.shape and got.dtype == torch.float32
    err = (got - want).abs().max().item()
    assert 0 < err <= rel * want.abs().max().item()  # > 0: the BF16 path did run


@pytest.mark.parametrize("module", ["half-bf16", "half-fp16", "Q4_K", "Q8_0"])
def test_bf16_prefill_matmul_is_close_to_fp32_and_decode_is_unchanged(module, monkeypatch):
    from ktlong import quant
    from ktlong.weights import QuantLinear, set_prefill_matmul

    monkeypatch.setattr(weights, "SCRATCH_FLOATS", 20000)  # several tiles per GEMM
    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 512)).astype(np.float32)
    if module.startswith("half"):
        mod = HalfLinear(torch.from_numpy(w), None, torch.bfloat16 if "bf16" in module
                         else torch.float16)
    else:
        mod = QuantLinear(quant.quantize(w, module), module, 512)
    holder = nn.Sequential(mod)
    x = torch.randn(1, 40, 512)
    with torch.inference_mode():
        assert set_prefill_matmul(holder, "FP32") == "FP32"
        want, one = mod(x), mod(x[:, :1])
        assert set_prefill_matmul(holder, "BF16") == "BF16" and mod.mm_dtype == torch.bfloat16
        got, one_bf16 = mod(x), mod(x[:, :1])
    _bf16_close(got, want)
    torch.testing.assert_close(one_bf16, one, rtol=0, atol=0)  # a decode row is the GEMV's


def test_bf16_prefill_auto_takes_wide_layers_on_a_bf16_cpu_only(monkeypatch):
    from ktlong.weights import bf16_prefill, set_prefill_matmul

    wide, narrow = HalfLinear(torch.randn(8, 1024), None, torch.bfloat16), HalfLinear(
        torch.randn(8, 256), None, torch.bfloat16)
    model = nn.Sequential(wide, narrow)
    monkeypatch.setattr(weights, "cpu_has_bf16", lambda: True)
    assert set_prefill_matmul(model, "AUTO") == "BF16"
    assert (wide.mm_dtype, narrow.mm_dtype) == (torch.bfloat16, torch.float32)
    assert bf16_prefill(4096, "AUTO") and not bf16_prefill(256, "AUTO")
    # SmolLM2-135M (576) and Gemma 3 270M (640) take BF16; the demo model (128) stays exact
    assert bf16_prefill(576, "AUTO") and bf16_prefill(640, "AUTO") and not bf16_prefill(128, "AUTO")
    assert bf16_prefill(256, "BF16") and not bf16_prefill(4096, "FP32")
    monkeypatch.setattr(weights, "cpu_has_bf16", lambda: False)
    assert set_prefill_matmul(model, "AUTO") == "FP32" and wide.mm_dtype == torch.float32
    assert not bf16_prefill(4096, "AUTO")


@pytest.mark.parametrize("half", [None, torch.bfloat16])
def test_gated_mlp_bf16_prefill_is_close_to_fp32(half):
    from transformers.models.llama.modeling_llama import LlamaMLP

    from ktlong.tinymodel import make_config
    from ktlong.weights import set_prefill_matmul

    torch.manual_seed(2)
    cfg = make_config("llama", hidden=64, intermediate=256)
    mlp = nn.Sequential(LlamaMLP(cfg).eval())
    weights.gate_mlps_in_place(mlp)
    if half is not None:
        for name in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(mlp[0], name)
            setattr(mlp[0], name, HalfLinear(lin.weight.detach(), None, half))
    x = torch.randn(1, 50, 64)
    with torch.inference_mode():
        set_prefill_matmul(mlp, "FP32")
        want = mlp(x)
        set_prefill_matmul(mlp, "BF16")
        got = mlp(x)
    _bf16_close(got, want, rel=0.03)


def test_bf16_prefill_changes_the_prompt_cache_key(monkeypatch):
    from ktlong.promptcache import content_key

    spec = load_model(hf_model("llama"), device="CPU").spec
    plain = content_key(spec, settings(prefill_matmul="FP32"))
    assert content_key(spec, settings(prefill_matmul="AUTO")) == plain  # a tiny model: FP32
    assert content_key(spec, settings(prefill_matmul="BF16"))["prefill_matmul"] == "BF16"
