"""GGUF weights kept quantised: the layouts and quantiser against the `gguf` package, the kernels
against its reference dequantisation, the modules against torch, and quantised files through the
engine against transformers running the same file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ktlong.kernels import qlinear as qk
from torch import nn

from ktlong import kernels, quant
from ktlong.engine import Sampling, Session
from ktlong.ggufload import qk_order
from ktlong.model import load_model
from ktlong.spec import read_spec
from ktlong.weights import QuantEmbedding, QuantLinear

from .models import gguf_model, hf_model, settings
from .test_engine import _prompt, _stock

QTYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
LEGACY = ("Q4_1", "Q5_0", "Q5_1")  # the 32-blocks of small models' Q4_K_M files, beside Q8_0
# the f16 fields of each block (byte offsets): scales d (and dmin / the legacy min m)
_HALVES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
           "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
_QH = {"Q5_0": 2, "Q5_1": 4}  # byte offset of the legacy 5-bit types' qh (u32)


def random_blocks(qtype: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Random bytes in `qtype`'s layout [rows, row_bytes]: every code, 6-bit scale, min and
    Q6_K sign pattern occurs; the f16 scales are finite, of both signs, some exactly 0; a legacy
    Q5's qh is all ones in some blocks, all zeros in others."""
    t = quant.TYPES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * k // t.block, t.nbytes), dtype=np.uint8)
    for o in _HALVES[qtype]:
        d = (rng.standard_normal(raw.shape[0]) * 0.01).astype(np.float16)
        d[rng.integers(0, 7, raw.shape[0]) == 0] = 0  # ~1 block in 7 has a 0 scale (or min)
        raw[:, o:o + 2] = d.view(np.uint8).reshape(-1, 2)
    if qtype in _QH:
        raw[0::3, _QH[qtype]:_QH[qtype] + 4] = 255
        raw[1::3, _QH[qtype]:_QH[qtype] + 4] = 0
    return raw.reshape(rows, t.row_bytes(k))


@pytest.mark.parametrize("qtype", LEGACY)
def test_random_blocks_cover_every_sign_and_scale_case(qtype):
    t = quant.TYPES[qtype]
    blocks = random_blocks(qtype, 9, 512, seed=t.ggml).reshape(-1, t.nbytes)
    for o in _HALVES[qtype]:  # d (and m): negative, zero and positive
        h = blocks[:, o:o + 2].copy().view(np.float16)[:, 0]
        assert (h < 0).any() and (h == 0).any() and (h > 0).any()
    if qtype in _QH:
        qh = blocks[:, _QH[qtype]:_QH[qtype] + 4].copy().view(np.uint32)[:, 0]
        assert (qh == 0xFFFFFFFF).any() and (qh == 0).any()


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequant_kernels_equal_the_gguf_reference_on_random_blocks(qtype):
    t = quant.TYPES[qtype]
    k = 2 * max(256, t.block)
    raw = random_blocks(qtype, 9, k, seed=t.ggml)
    ref = quant.dequantize_ref(raw, qtype, k)  # [9, k]
    np.testing.assert_allclose(kernels.dequant(raw, t.ggml, k, 0, 9), ref, rtol=1e-6, atol=1e-7)
    c0 = t.block  # a tile off the first block, some rows
    np.testing.assert_allclose(kernels.dequant(raw, t.ggml, k, 2, 7, c0, k), ref[2:7, c0:],
                               rtol=1e-6, atol=1e-7)
    ids = np.array([8, 0, 3, 3])
    np.testing.assert_allclose(kernels.dequant_rows(raw, t.ggml, k, ids), ref[ids],
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("k", [256, 512, 1280])
def test_qgemv_equals_the_reference_on_random_blocks(qtype, k):
    t = quant.TYPES[qtype]
    raw = random_blocks(qtype, 53, k, seed=k + t.ggml)
    x = np.random.default_rng(k).standard_normal(k).astype(np.float32)
    wd = quant.dequantize_ref(raw, qtype, k).astype(np.float64)  # [53, k]
    # the float path: exact up to float32 sums
    got = qk._qgemv(qk.readonly(raw), t.ggml, x)
    np.testing.assert_allclose(got, wd @ x, rtol=1e-4, atol=1e-5 * np.abs(wd @ x).max())
    # a small matrix on the calling thread alone: the same sums, row by row
    np.testing.assert_array_equal(qk._qgemv(qk.readonly(raw), t.ggml, x, True), got)
    if not qk.int8_path(t.ggml, k):
        return
    # the int8 path (VNNI or AVX2): exactly W times x rounded to int8 (per 32 channels, per 256
    # for K-quants) ...
    group = 256 if t.block == 256 else 32
    codes, dx, _, _ = qk._quantise_x(x, group)
    xr = codes.astype(np.float64) * np.repeat(dx, group)
    fast = kernels.qgemv(raw, t.ggml, x)
    np.testing.assert_allclose(fast, wd @ xr, rtol=1e-4, atol=1e-5 * np.abs(wd @ xr).max())
    # ... which is within 2% of the largest output of W x (llama.cpp rounds x the same way)
    assert np.abs(fast - wd @ x).max() <= 0.02 * np.abs(wd @ x).max()


# the decode GEMV as a CPU without AVX-512 runs it (ktlong.bench.qgemm.narrow_prelude: Numba
# compiles for haswell and the kernels see W = 8): AVX2's int8 path, or the float path
_AVX2_CHILD = """
import json, sys
import numpy as np
from ktlong import kernels
from ktlong.kernels import _vec, qlinear as qk
from tests.test_quant import random_blocks
got = {}
for name, ggml in json.loads(sys.argv[1]).items():
    x = np.random.default_rng(ggml).standard_normal(512).astype(np.float32)
    got[name] = [kernels.qgemv(random_blocks(name, 37, 512, seed=ggml), ggml, x).tolist(),
                 bool(qk.int8_path(ggml, 512))]
print(json.dumps({"W": _vec.W, "got": got}))
"""


def test_qgemv_on_a_cpu_without_avx512():
    """Every type's decode GEMV compiled and run as on an AVX2-only CPU: W x rounded to int8
    where it takes the int8 path (vpmaddubsw), W x in float32 where it does not."""
    import json
    import os
    import subprocess
    import sys

    from ktlong.kernels import qmatmul

    from ktlong.bench.qgemm import narrow_prelude

    if not qmatmul.HAVE_PATH["avx2"]:
        pytest.skip("this CPU runs no AVX2 code")
    types_ = {name: quant.TYPES[name].ggml for name in QTYPES}
    out = subprocess.run([sys.executable, "-c", narrow_prelude("avx2") + _AVX2_CHILD,
                          json.dumps(types_)], capture_output=True, text=True, timeout=900,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["W"] == 8
    int8 = 0
    for name, ggml in types_.items():
        got, on_int8 = np.asarray(res["got"][name][0]), res["got"][name][1]
        x = np.random.default_rng(ggml).standard_normal(512).astype(np.float32)
        wd = quant.dequantize_ref(random_blocks(name, 37, 512, seed=ggml), name, 512)
        wd = wd.astype(np.float64)
        if on_int8:
            int8 += 1
            group = 256 if quant.TYPES[name].block == 256 else 32
            codes, dx, _, _ = qk._quantise_x(x, group)
            x = codes.astype(np.float64) * np.repeat(dx, group)
        want = wd @ x
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max(),
                                   err_msg=name)
    assert int8 >= 4  # Q8_0, Q4_0, Q4_1, Q4_K, Q6_K take AVX2's int8 path


def _int8_reference(raw: np.ndarray, qtype: str, x: np.ndarray) -> np.ndarray:
    """W times x rounded to int8 as the int8 paths round it (per 32 channels, 256 for K-quants),
    in float64."""
    t = quant.TYPES[qtype]
    group = 256 if t.block == 256 else 32
    codes, dx, _, _ = qk._quantise_x(x, group)
    xr = codes.astype(np.float64) * np.repeat(dx, group)
    return quant.dequantize_ref(raw, qtype, x.shape[0]).astype(np.float64) @ xr


def _want(raw: np.ndarray, qtype: str, x: np.ndarray) -> np.ndarray:
    """What qgemv gives on this CPU: the int8 reference where it takes an int8 path."""
    if qk.int8_path(quant.TYPES[qtype].ggml, x.shape[0]):
        return _int8_reference(raw, qtype, x)
    return kernels.qgemv_ref(raw, quant.TYPES[qtype].ggml, x)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 6, 37])
def test_qgemv_takes_any_row_count_and_writes_into_out(qtype, rows):
    """Row counts under and over a work item's, odd ones among them; rows of 18
    32-blocks (four groups of four and a tail of two) or 3 super-blocks; `out` reused."""
    t = quant.TYPES[qtype]
    k = 768 if t.block == 256 else 576
    raw = random_blocks(qtype, rows, k, seed=rows + t.ggml)
    x = np.random.default_rng(rows).standard_normal(k).astype(np.float32)
    got = kernels.qgemv(raw, t.ggml, x)
    want = _want(raw, qtype, x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    out = np.full(rows, np.nan, np.float32)
    assert kernels.qgemv(raw, t.ggml, x, out=out) is out
    np.testing.assert_array_equal(out, got)
    out[:] = np.nan  # a second call into the same buffer
    kernels.qgemv(raw, t.ggml, 2 * x, out=out)
    np.testing.assert_allclose(out, 2 * got, rtol=1e-5, atol=1e-6 * np.abs(got).max())


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K"])
def test_qgemv_on_two_threads_equals_one_thread(qtype, monkeypatch):
    """The parallel path (work items of 16 rows over two threads) gives what the serial one
    gives, row for row."""
    t = quant.TYPES[qtype]
    k = 768 if t.block == 256 else 576
    raw = random_blocks(qtype, 301, k, seed=t.ggml)
    x = np.random.default_rng(5).standard_normal(k).astype(np.float32)
    try:
        kernels.configure_threads(1)
        one = kernels.qgemv(raw, t.ggml, x)
        kernels.configure_threads(2)
        monkeypatch.setattr(qk, "SERIAL_BYTES", 0)  # parallel however small
        two = kernels.qgemv(raw, t.ggml, x)
    finally:
        kernels.configure_threads(0)
    np.testing.assert_array_equal(two, one)
    want = _want(raw, qtype, x)
    np.testing.assert_allclose(two, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_0", "Q4_K"])
@pytest.mark.parametrize("threads", [1, 2])
def test_qgemv2_gives_each_matrix_what_qgemv_gives(qtype, threads, monkeypatch):
    """Two matrices of one input in one call (q and k, gate and up): each output row for row as
    its own qgemv, serial or over two threads, with rows in counts no item size divides."""
    t = quant.TYPES[qtype]
    k = 768 if t.block == 256 else 576
    a = random_blocks(qtype, 301, k, seed=t.ggml)
    b = random_blocks(qtype, 38, k, seed=t.ggml + 1)
    x = np.random.default_rng(9).standard_normal(k).astype(np.float32)
    monkeypatch.setattr(qk, "SERIAL_BYTES", 0)  # parallel however small
    try:
        kernels.configure_threads(threads)
        ya, yb = kernels.qgemv2(a, b, t.ggml, x)
        want_a, want_b = kernels.qgemv(a, t.ggml, x), kernels.qgemv(b, t.ggml, x)
    finally:
        kernels.configure_threads(0)
    np.testing.assert_array_equal(ya, want_a)
    np.testing.assert_array_equal(yb, want_b)
    with pytest.raises(ValueError, match="uint8 rows"):
        kernels.qgemv2(a, b[:, :-2], t.ggml, x)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_qgemv_without_an_int8_path_takes_the_float_path_into_out(qtype, monkeypatch):
    """Where neither AVX512-VNNI nor AVX2 is there, qgemv runs the float kernel, `out` as well."""
    monkeypatch.setattr(qk, "VNNI", False)
    monkeypatch.setattr(qk, "AVX2", False)
    t = quant.TYPES[qtype]
    k = 768 if t.block == 256 else 576
    raw = random_blocks(qtype, 7, k, seed=t.ggml)
    x = np.random.default_rng(7).standard_normal(k).astype(np.float32)
    out = np.full(7, np.nan, np.float32)
    assert kernels.qgemv(raw, t.ggml, x, out=out) is out
    want = kernels.qgemv_ref(raw, t.ggml, x)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_qgemv_refuses_an_unfit_out():
    raw = random_blocks("Q8_0", 4, 64)
    x = np.zeros(64, np.float32)
    strided = np.zeros((4, 2), np.float32)[:, 0]
    for bad in (np.zeros(5, np.float32), np.zeros(4, np.float64), strided):
        with pytest.raises(ValueError, match="out must be"):
            kernels.qgemv(raw, 8, x, out=bad)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", *LEGACY])
def test_qgemv_over_an_odd_number_of_32_blocks(qtype):
    """A row of 19 blocks: the VNNI path takes four 32-blocks a step and sends it the float way
    (exact up to float32 sums, no int8 rounding of x); the AVX2 path takes two a step and the
    last one alone."""
    t, k = quant.TYPES[qtype], 19 * 32
    raw = random_blocks(qtype, 21, k, seed=3)
    x = np.random.default_rng(3).standard_normal(k).astype(np.float32)
    assert qk.int8_path(t.ggml, k) == (qk.AVX2 and t.ggml in qk.AVX2_TYPES)
    want = _want(raw, qtype, x)
    np.testing.assert_allclose(kernels.qgemv(raw, t.ggml, x), want, rtol=1e-4,
                               atol=1e-5 * np.abs(want).max())


def test_qgemv_ref_is_the_gguf_dequantisation_times_x():
    raw = random_blocks("Q4_K", 4, 256)
    x = np.ones(256, np.float32)
    np.testing.assert_allclose(kernels.qgemv_ref(raw, 12, x),
                               quant.dequantize_ref(raw, "Q4_K", 256).sum(1), rtol=1e-6)


@pytest.mark.parametrize("qtype,bound", [("Q8_0", 0.005), ("Q4_0", 0.13), ("Q4_1", 0.07),
                                         ("Q5_0", 0.07), ("Q5_1", 0.035), ("Q4_K", 0.07),
                                         ("Q5_K", 0.035), ("Q6_K", 0.02)])
def test_quantise_round_trip_error_is_bounded(qtype, bound):
    """Error over each row's largest |x|: half a step, plus one step where a format has one level
    fewer on one side (Q4_0: -8d..7d, Q5_0: -16d..15d), plus the rounding of 6-bit K-quant
    scales."""
    x = np.random.default_rng(1).standard_normal((16, 512)).astype(np.float32)
    x[3] = 0.0  # an all-zero row: scales 0, no NaN
    x[5] = np.abs(x[5])  # all positive: the K-quant min is 0
    back = quant.dequantize_ref(quant.quantize(x, qtype), qtype, 512)
    assert np.isfinite(back).all() and not back[3].any()
    err = np.abs(back - x).max(axis=1) / np.maximum(np.abs(x).max(axis=1), 1e-12)
    assert err.max() <= bound, (qtype, err.max())


def test_quantise_refuses_rows_off_the_block():
    with pytest.raises(ValueError, match="multiple of 256"):
        quant.quantize(np.zeros((2, 100), np.float32), "Q4_K")


def test_kernels_refuse_bad_shapes():
    raw = random_blocks("Q8_0", 4, 64)
    with pytest.raises(ValueError, match="rows of 96"):
        kernels.qgemv(raw, 8, np.zeros(96, np.float32))
    with pytest.raises(ValueError, match="off its 32-element blocks"):
        kernels.dequant(raw, 8, 64, 0, 4, 0, 40)
    with pytest.raises(ValueError, match="out of range"):
        kernels.dequant_rows(raw, 8, 64, np.array([4]))


def test_qk_order_undoes_llama_cpp_permutation():
    from ktlong.tinymodel import _permute_qk

    w = np.arange(4 * 8 * 3).reshape(4 * 8, 3)  # 4 heads of head_dim 8, rows = outputs
    file_rows = _permute_qk(w, 4)
    np.testing.assert_array_equal(file_rows[qk_order(32, 4)], w)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", *LEGACY, "F16", "F32"])
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_quant_linear_equals_linear_over_the_dequantised_weight(qtype, rows, monkeypatch):
    from ktlong import weights

    monkeypatch.setattr(weights, "SCRATCH_FLOATS", 3000)  # several tiles per GEMM
    rng = np.random.default_rng(rows)
    w = rng.standard_normal((48, 512)).astype(np.float32)
    raw = quant.quantize(w, qtype)
    perm = rng.permutation(48)
    bias = torch.randn(48)
    mod = QuantLinear(raw, qtype, 512, bias, perm)
    ref = nn.Linear(512, 48)
    ref.weight.data = torch.from_numpy(quant.dequantize_ref(raw, qtype, 512)[perm].copy())
    ref.bias.data = bias
    x = torch.randn(1, rows, 512)
    with torch.inference_mode():
        got, want = mod(x), ref(x)
    tol = 0.02 if rows == 1 and qtype not in ("F16", "F32") else 1e-4  # int8-rounded x
    assert got.shape == want.shape
    assert (got - want).abs().max() <= tol * want.abs().max()


def test_quant_embedding_looks_up_dequantised_rows():
    w = np.random.default_rng(0).standard_normal((20, 256)).astype(np.float32)
    table = QuantLinear(quant.quantize(w, "Q6_K"), "Q6_K", 256)
    emb = QuantEmbedding(table, torch.float32)
    ids = torch.tensor([[3, 0, 19], [3, 3, 7]])
    ref = torch.from_numpy(quant.dequantize_ref(table.raw, "Q6_K", 256))[ids]
    torch.testing.assert_close(emb(ids), ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", *LEGACY])
def test_quantised_gguf_decodes_the_tokens_transformers_decodes_from_the_same_file(qtype):
    path = gguf_model("llama", qtype)
    lm = load_model(path, device="CPU")
    assert lm.weight_type == f"GGUF {qtype}"
    lins = [m for m in lm.model.modules() if isinstance(m, QuantLinear)]
    assert lins and not [m for m in lm.model.modules() if isinstance(m, nn.Linear)]
    assert all(not m.raw.flags.writeable for m in lins)  # views of the mapped file, no copies
    ids = _prompt(lm.tokenizer)[:400]
    s = Session(lm, settings(attention="DENSE"))
    logits = s.prefill(ids, all_logits=True)
    got = [st.token_id for st in s.generate(Sampling(max_new_tokens=16))]
    stock = _stock(path)  # transformers dequantises the file through gguf-py
    with torch.no_grad():
        ref_logits = stock(torch.tensor([ids])).logits[0]
        ref = stock.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    assert (logits - ref_logits).abs().max().item() < 1e-4
    assert got == ref[0, len(ids):].tolist()


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_gguf_layer_outputs_match_the_dequantised_model(qtype):
    """A 256-wide llama in a K-quant: ktlong over the file's blocks against transformers over
    the same values dequantised. Prefill (tiles) agrees to 1e-4; decode rounds x to int8 per 32
    channels, so its logits agree to 3% of their largest magnitude."""
    folder = hf_model("llama", hidden=256, heads=4, kv_heads=2, intermediate=512)
    from ktlong.tinymodel import write_gguf

    path = write_gguf(folder, folder.parent / f"{folder.name}-{qtype}.gguf", qtype)
    lm = load_model(path, device="CPU")
    assert lm.weight_type == f"GGUF {qtype}"
    ids = _prompt(lm.tokenizer)[:300]
    s = Session(lm, settings(attention="DENSE"))
    logits = s.prefill(ids, all_logits=True)
    stock = _stock(path)
    with torch.no_grad():
        ref = stock(torch.tensor([ids])).logits[0]
    assert (logits - ref).abs().max().item() < 1e-4 * ref.abs().max().item() + 1e-4
    nxt = int(ref[-1].argmax())
    one = s.prefill([nxt])[-1]  # one row: the int8 GEMV
    with torch.no_grad():
        want = stock(torch.tensor([ids + [nxt]])).logits[0, -1]
    assert (one - want).abs().max().item() < 0.03 * want.abs().max().item()


def test_spec_counts_gguf_weights_at_their_size_in_the_file():
    import gguf

    path = gguf_model("llama", "Q4_0")
    spec = read_spec(path)
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)
    assert spec.weights_bytes == file_bytes


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", *LEGACY, "Q4_K", "Q5_K", "Q6_K"])
def test_dequant_to_bf16_is_the_reference_rounded_to_bf16(qtype):
    from ktlong.kernels.qlinear import BLOCK

    rng = np.random.default_rng(7)
    raw = quant.quantize(rng.standard_normal((9, 512)).astype(np.float32), qtype)
    code = quant.TYPES[qtype].ggml
    blk = BLOCK[code][0]
    got = kernels.dequant(raw, code, 512, 2, 7, blk, 512, bf16=True)  # [5, 512 - blk] bits
    ref = torch.from_numpy(quant.dequantize_ref(raw, qtype, 512)[2:7, blk:].copy())
    assert got.dtype == np.uint16 and got.shape == (5, 512 - blk)
    want = ref.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)  # nearest even
    np.testing.assert_array_equal(got, want)


def test_qgemv_stays_exact_whatever_the_heap_holds():
    """Many calls of varied sizes with allocations between them: the int8 path's codes of x must
    live until its loop ends (addresses taken before the loop once read memory that the output
    array reused: ~2% of calls wrong). The AVX2 int8 path and the float path read rows and x by
    address too, and must stay exact the same way."""
    from ktlong.kernels import qlinear as qk

    wrong = []
    for trial in range(150):
        qtype = ["Q5_K", "Q4_K", "Q6_K", "Q8_0", "Q4_0"][trial % 5]
        k, n = [256, 512, 1280, 2048][trial % 4], 1 + (trial * 7) % 90
        rng = np.random.default_rng(trial)
        t = quant.TYPES[qtype]
        raw = quant.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
        x = rng.standard_normal(k).astype(np.float32)
        junk = [np.empty(int(s)) for s in rng.integers(1, 400, 5)]  # noqa: F841  (heap churn)
        xr = x.astype(np.float64)
        if qk.int8_path(t.ggml, k):  # the int8 path: x rounded to int8 codes
            group = 256 if t.block == 256 else 32
            codes, dx, _, _ = qk._quantise_x(x, group)
            xr = codes.astype(np.float64) * np.repeat(dx, group)
        want = quant.dequantize_ref(raw, qtype, k).astype(np.float64) @ xr
        got = kernels.qgemv(raw, t.ggml, x)
        if not np.allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max()):
            wrong.append((qtype, k, n))
    assert not wrong
