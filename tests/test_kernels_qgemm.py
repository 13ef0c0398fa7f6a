"""The quantised prefill GEMM (kernels/qmatmul.py, kernels/_qtile.py): exactly W times x rounded
to int8 as the decode GEMV rounds it, for every GGUF type, on every tile product this CPU has
(AMX, AVX512-VNNI, AVX-VNNI, AVX2), at row and token counts off the 16-row tiles, at the codes'
extremes (the AVX2 product's int16 sums); the AVX2 and AVX-VNNI products compiled for CPUs
without AVX-512; and the modules that take it for prefill."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from ktlong.kernels import _qtile as qt
from ktlong.kernels import qlinear as qk
from ktlong.kernels import qmatmul as qm
from torch import nn

from ktlong import kernels, quant, weights
from ktlong.bench.qgemm import narrow_prelude
from ktlong.weights import GatedMLP, QuantLinear, set_prefill_matmul

from .test_quant import _HALVES, QTYPES, random_blocks

pytestmark = pytest.mark.skipif(not kernels.INT8_GEMM,
                                reason="needs AMX, AVX512-VNNI, AVX-VNNI or AVX2")
PRODUCTS = [p for p in qm.GEMM_PATHS if qm.HAVE_PATH[p]]  # every product this CPU can run


def _reference(raw: np.ndarray, qtype: str, x: np.ndarray) -> np.ndarray:
    """W times x rounded per row as the decode GEMV rounds one vector (`_quantise_x`), float64:
    an independent rounding, row by row."""
    t = quant.TYPES[qtype]
    group = qm.x_group(t.ggml)
    xr = np.empty(x.shape, np.float64)
    for r in range(x.shape[0]):
        codes, dx, _, _ = qk._quantise_x(np.ascontiguousarray(x[r]), group)
        xr[r] = codes.astype(np.float64) * np.repeat(dx, group)
    return xr @ quant.dequantize_ref(raw, qtype, x.shape[1]).astype(np.float64).T


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("path", PRODUCTS)
@pytest.mark.parametrize(("tokens", "rows", "k"), [(21, 37, 512), (16, 16, 256), (5, 50, 1280)])
def test_qgemm_equals_w_times_int8_rounded_x(qtype, path, tokens, rows, k):
    t = quant.TYPES[qtype]
    raw = random_blocks(qtype, rows, k, seed=k + t.ggml)
    x = np.random.default_rng(tokens).standard_normal((tokens, k)).astype(np.float32)
    x[1] *= 30  # rows of other scales
    x[2] = 0  # and an all-zero row
    got = kernels.qgemm(raw, t.ggml, x, path=path)
    want = _reference(raw, qtype, x)
    assert got.shape == (tokens, rows) and got.dtype == np.float32
    scale = np.abs(want).max(axis=1, keepdims=True) + 1e-30
    assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max()
    assert (np.abs(got - want) / scale).max() <= 1e-4  # each token row to its own size
    assert not got[2].any()
    # ... and within 3% of the largest output of W x (llama.cpp rounds x the same way)
    exact = x.astype(np.float64) @ quant.dequantize_ref(raw, qtype, k).astype(np.float64).T
    assert np.abs(got - exact).max() <= 0.03 * np.abs(exact).max()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
@pytest.mark.parametrize("path", PRODUCTS)
def test_qgemm_over_an_odd_number_of_sub_blocks(qtype, path):
    """K = 96: three 32-blocks (the AMX loop takes pairs: the VNNI product takes it)."""
    t = quant.TYPES[qtype]
    raw = random_blocks(qtype, 19, 96, seed=3)
    x = np.random.default_rng(3).standard_normal((18, 96)).astype(np.float32)
    got, want = kernels.qgemm(raw, t.ggml, x, path=path), _reference(raw, qtype, x)
    assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max()


_SCALES = {"Q4_K": (4, 16), "Q5_K": (4, 16), "Q6_K": (192, 208)}  # bytes of 6/8-bit scales


def _extreme_blocks(qtype: str, rows: int, k: int) -> np.ndarray:
    """Random scales, every code at its top (even rows: bytes 0xFF; Q8_0: +127) or bottom
    (odd rows: 0x00; Q8_0: -128): the largest products the int8 GEMM can meet."""
    t = quant.TYPES[qtype]
    raw = random_blocks(qtype, rows, k, seed=17).reshape(rows, -1, t.nbytes)
    keep = np.zeros(t.nbytes, bool)
    for o in _HALVES[qtype]:
        keep[o:o + 2] = True
    if qtype in _SCALES:
        keep[slice(*_SCALES[qtype])] = True
    top, bottom = (0x7F, 0x80) if qtype == "Q8_0" else (0xFF, 0x00)
    raw[0::2, :, ~keep] = top
    raw[1::2, :, ~keep] = bottom
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("path", PRODUCTS)
def test_qgemm_at_the_codes_extremes(qtype, path):
    """Codes at their ends times token codes at +-127 (rows of one value, of both signs): the
    AVX2 product sums up to 8 `vpmaddubsw` pairs in int16 (2 x 15 x 127 each for 4-bit codes,
    2 x 63 x 127 for Q6_K's, 2 x 128 x 127 for Q8_0's magnitudes), where one product more in a
    sum, or Q8_0 as unsigned codes (2 x 255 x 127), would wrap or saturate."""
    t = quant.TYPES[qtype]
    k = 512
    raw = _extreme_blocks(qtype, 32, k)
    x = np.ones((20, k), np.float32)
    x[1::2] = -1
    x[4] = np.where(np.arange(k) % 2, 3.0, -3.0)
    got, want = kernels.qgemm(raw, t.ggml, x, path=path), _reference(raw, qtype, x)
    assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max()


# A child process taken for a CPU without AVX-512 (and, for "avx2", without AVX-VNNI;
# ktlong.bench.qgemm.narrow_prelude): Numba compiles for that CPU (an AVX-512 instruction would
# not compile) and ktlong's kernels see W = 8 and pick that tile product by themselves
_CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    from ktlong.kernels import _vec, qmatmul
    from tests.test_quant import random_blocks
    got = {}
    for name, ggml in json.loads(sys.argv[1]).items():
        x = np.random.default_rng(ggml).standard_normal((21, 512)).astype(np.float32)
        got[name] = qmatmul.qgemm(random_blocks(name, 37, 512, seed=ggml), ggml, x).tolist()
    print(json.dumps({"W": _vec.W, "path": qmatmul.GEMM_PATH, "got": got}))
""")


@pytest.mark.parametrize("path", ["avx2", "avx-vnni"])
def test_qgemm_on_a_cpu_without_avx512(path):
    if not qm.HAVE_PATH[path] or (path == "avx-vnni" and "+avxvnni" not in qt._FEATURES):
        pytest.skip(f"this CPU cannot run {path} code without AVX-512")
    types_ = {name: quant.TYPES[name].ggml for name in QTYPES}
    code = narrow_prelude(path) + _CHILD
    out = subprocess.run([sys.executable, "-c", code, json.dumps(types_)],
                         capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["W"] == 8 and res["path"] == path
    for name, ggml in types_.items():
        x = np.random.default_rng(ggml).standard_normal((21, 512)).astype(np.float32)
        want = _reference(random_blocks(name, 37, 512, seed=ggml), name, x)
        got = np.asarray(res["got"][name], np.float32)
        assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max(), name


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_0"])
def test_qgemm_on_two_threads_equals_one_thread(qtype):
    t = quant.TYPES[qtype]
    raw = random_blocks(qtype, 70, 512, seed=5)
    x = np.random.default_rng(5).standard_normal((40, 512)).astype(np.float32)
    try:
        kernels.configure_threads(1)
        one = kernels.qgemm(raw, t.ggml, x)
        kernels.configure_threads(2)
        two = kernels.qgemm(raw, t.ggml, x)
    finally:
        kernels.configure_threads(0)
    np.testing.assert_array_equal(one, two)


def test_quantise_rows_rounds_each_row_as_the_gemv_rounds_x():
    x = np.random.default_rng(7).standard_normal((3, 512)).astype(np.float32)
    for qtype, g, group in (("Q4_K", 32, 256), ("Q6_K", 16, 256), ("Q8_0", 32, 32)):
        codes, dxs, sv = kernels.quantise_rows(x, quant.TYPES[qtype].ggml)
        assert codes.shape == (16, 512 + qm.PAD) and dxs.shape == sv.shape == (16, 512 // g)
        for r in range(3):
            c, dx, _, _ = qk._quantise_x(x[r], group)
            np.testing.assert_array_equal(codes[r, :512], c)
            np.testing.assert_array_equal(dxs[r], np.repeat(dx, group // g))
            sums = c.reshape(-1, g).astype(np.int64).sum(axis=1)
            np.testing.assert_allclose(sv[r], dxs[r] * sums, rtol=1e-6)
        assert not codes[3:].any() and not dxs[3:].any()  # the tile's padding rows


def test_qgemm_refuses_what_it_cannot_multiply():
    raw = random_blocks("Q4_K", 4, 256)
    with pytest.raises(ValueError, match="uint8 rows"):
        kernels.qgemm(raw, 12, np.zeros((2, 512), np.float32))
    with pytest.raises(ValueError, match="unknown quant type"):
        kernels.qgemm(np.zeros((2, 8), np.uint8), 0, np.zeros((2, 2), np.float32))


def test_quant_linear_int8_prefill_and_its_shared_rounding():
    """QuantLinear under INT8: the GEMM's result; two matrices of one input share one rounding
    (q, k), and an input changed in place is rounded again."""
    rng = np.random.default_rng(9)
    raws = [random_blocks("Q4_K", 48, 1024, seed=s) for s in (1, 2)]
    mods = [QuantLinear(r, "Q4_K", 1024) for r in raws]
    holder = nn.Sequential(*mods)
    assert set_prefill_matmul(holder, "AUTO") == "INT8" and all(m.int8 for m in mods)
    x = torch.from_numpy(rng.standard_normal((1, 20, 1024)).astype(np.float32))
    with torch.inference_mode():
        y0, y1 = mods[0](x), mods[1](x)
        for raw, y in zip(raws, (y0, y1), strict=True):
            want = _reference(raw, "Q4_K", x[0].numpy())
            assert y.shape == (1, 20, 48)
            assert (y[0].numpy() - want).__abs__().max() <= 2e-5 * np.abs(want).max()
        x[0, 0] += 1  # same memory, new values
        z = mods[0](x)
    want = _reference(raws[0], "Q4_K", x[0].numpy())
    assert np.abs(z[0].numpy() - want).max() <= 2e-5 * np.abs(want).max()


def test_auto_takes_int8_for_wide_quantised_layers_only(monkeypatch):
    wide = QuantLinear(random_blocks("Q4_K", 8, 1024), "Q4_K", 1024)
    narrow = QuantLinear(random_blocks("Q4_K", 8, 512), "Q4_K", 512)
    model = nn.Sequential(wide, narrow)
    monkeypatch.setattr(weights, "cpu_has_bf16", lambda: True)
    assert set_prefill_matmul(model, "AUTO") == "INT8"
    assert wide.int8 and not narrow.int8 and narrow.mm_dtype == torch.bfloat16
    assert set_prefill_matmul(model, "INT8") == "INT8" and narrow.int8  # INT8: any width
    assert set_prefill_matmul(model, "BF16") == "BF16" and not wide.int8
    assert weights.prefill_precision(4096, "AUTO") == "INT8"
    assert weights.prefill_precision(576, "AUTO") == "BF16"  # SmolLM2, Gemma 3 270M: BF16
    monkeypatch.setattr(kernels, "INT8_GEMM", False)  # a CPU without it
    assert set_prefill_matmul(model, "INT8") == "BF16" and not wide.int8


def test_gated_mlp_int8_prefill_is_close_to_fp32():
    from transformers.models.llama.modeling_llama import LlamaMLP

    from .test_weights import _bf16_close

    class Cfg:
        hidden_size, intermediate_size, hidden_act, mlp_bias = 1024, 2048, "silu", False

    mlp = LlamaMLP(Cfg())
    rng = np.random.default_rng(11)
    for name, k in (("gate_proj", 1024), ("up_proj", 1024), ("down_proj", 2048)):
        w = getattr(mlp, name).weight.detach().numpy()
        raw = quant.quantize(rng.standard_normal(w.shape).astype(np.float32) * 0.05, "Q4_K")
        setattr(mlp, name, QuantLinear(raw, "Q4_K", k))
    gated = GatedMLP(mlp)
    holder = nn.Sequential(gated)
    x = torch.randn(1, 33, 1024)
    with torch.inference_mode():
        assert set_prefill_matmul(holder, "FP32") == "FP32"
        want = gated(x)
        assert set_prefill_matmul(holder, "AUTO") == "INT8" and gated.int8
        got = gated(x)
    _bf16_close(got, want, rel=0.03)


def test_bench_qgemm_refuses_an_unknown_cpu_or_product_in_one_line():
    from typer.testing import CliRunner

    from ktlong.cli import app

    for args, said in ((["--cpu", "sse2"], "--cpu sse2: not one of avx-vnni, avx2"),
                       (["--paths", "neon"], "no neon int8 GEMM on this CPU")):
        r = CliRunner().invoke(app, ["bench", "qgemm", *args])
        assert r.exit_code == 2 and said in r.output and "Traceback" not in r.output
