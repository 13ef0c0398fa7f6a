"""The engine against transformers' own forward and generate, on the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from ktlong.engine import Sampling, Session
from ktlong.errors import KtlongError
from ktlong.model import load_model
from ktlong.spec import read_spec
from ktlong.tinymodel import filler_text

from .models import ARCHS, gguf_model, hf_model, settings

PROMPT_TOKENS = 2000


def _prompt(tokenizer, n: int = PROMPT_TOKENS, seed: int = 0) -> list[int]:
    ids = tokenizer(filler_text(n, seed=seed))["input_ids"]
    assert len(ids) >= n
    return ids[:n]


def _stock(path) -> torch.nn.Module:
    if str(path).endswith(".gguf"):
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        cfg.head_dim = read_spec(path).head_dim  # transformers drops attention.key_length
        return AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, config=cfg, attn_implementation="sdpa"
        ).eval()
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("arch", ARCHS)
def test_dense_decode_equals_transformers_generate(arch, fmt, capsys):
    path = hf_model(arch) if fmt == "hf" else gguf_model(arch)
    lm = load_model(path, device="CPU", dtype="float32")
    ids = _prompt(lm.tokenizer)
    s = Session(lm, settings(attention="DENSE"))
    logits = s.prefill(ids, all_logits=True)  # [n, vocab], chunked: 2000 tokens / 256
    got = [st.token_id for st in s.generate(Sampling(max_new_tokens=32))]

    stock = _stock(path)
    with torch.no_grad():
        ref_logits = stock(torch.tensor([ids])).logits[0]
        ref = stock.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids) :]
    diff = (logits - ref_logits).abs().max().item()
    with capsys.disabled():
        print(f"\n[{arch}/{fmt}] prefill logits max |diff| = {diff:.2e}")
    assert diff < 1e-4
    assert got == ref.tolist()
    assert len(got) >= 1


def test_second_turn_equals_fresh_prefill():
    lm = load_model(hf_model("llama"), device="CPU", dtype="float32")
    doc, turn = _prompt(lm.tokenizer, 1500, seed=1), _prompt(lm.tokenizer, 300, seed=2)
    a = Session(lm, settings(attention="DENSE"))
    a.prefill(doc)
    first = [st.token_id for st in a.generate(Sampling(max_new_tokens=8))]
    before = a.store.length
    a.extend_to(doc + first + turn)  # only the answer's last token and the turn are new
    assert a.store.length - before == 1 + len(turn)
    second = [st.token_id for st in a.generate(Sampling(max_new_tokens=16))]

    b = Session(lm, settings(attention="DENSE"))
    b.prefill(doc + first + turn)
    fresh = [st.token_id for st in b.generate(Sampling(max_new_tokens=16))]
    assert second == fresh
    assert len(a.tokens) == len(b.tokens)


def test_prompt_longer_than_max_seq_len_is_refused_before_work():
    lm = load_model(hf_model("llama"), device="CPU", dtype="float32")
    s = Session(lm, settings(max_seq_len=1024))
    with pytest.raises(KtlongError) as e:
        s.prefill(_prompt(lm.tokenizer, 1500))
    assert "1,500 tokens" in e.value.message and "memcheck" in e.value.hint
    assert s.store.length == 0 and s.tokens == []


def test_prefill_never_builds_a_full_context_attention_matrix():
    """Track every tensor torch creates during a chunked prefill: none is [L, L]-sized."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Biggest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    Biggest.numel = max(Biggest.numel, t.numel())
            return out

    lm = load_model(hf_model("llama"), device="CPU", dtype="float32")
    n, chunk = 4096, 256
    s = Session(lm, settings(attention="DENSE", chunk_size=chunk))
    ids = _prompt(lm.tokenizer, n)
    embedded: list[int] = []  # tokens embedded at once: on the CPU, one chunk's hidden states
    hook = lm.model.model.embed_tokens.register_forward_hook(
        lambda mod, args, out: embedded.append(out.shape[-2]))
    seen: list[int] = []
    try:
        with Biggest():
            s.prefill(ids, progress=lambda done, total: seen.append(done))
    finally:
        hook.remove()
    hq = lm.spec.n_heads
    assert Biggest.numel < hq * n * n // 8  # a full [Hq, L, L] score matrix would be 8x this
    assert s.store.length == n
    assert embedded == [chunk] * (n // chunk)  # never the whole prompt's [n, hidden]
    assert seen == sorted(seen) and seen[-1] == n


def test_fused_and_tiled_prefill_attention_agree():
    """The CPU fused-kernel path (per KV head, segments + LSE merges) equals the portable tiled
    path, and hands transformers a token-major output (its reshape for o_proj copies nothing)."""
    from types import SimpleNamespace

    import ktlong.attention as att
    from ktlong.kvstore import KVStore, StoreShape

    Hq, Hkv, d, past, chunk = 8, 2, 16, 3000, 700
    store = KVStore(StoreShape(1, Hkv, d, 16, "FP32", 1), past + chunk)
    g = torch.Generator().manual_seed(0)
    store.write(0, torch.randn(Hkv, past, d, generator=g), torch.randn(Hkv, past, d, generator=g))
    store.write(0, torch.randn(Hkv, chunk, d, generator=g), torch.randn(Hkv, chunk, d, generator=g))
    exact = SimpleNamespace(s=SimpleNamespace(prefill="DENSE", prefill_window=0, init_len=0))
    router = att.AttentionRouter(store, exact, torch.device("cpu"))
    q = torch.randn(Hq, chunk, d, generator=g)
    old = att.PAST_SEGMENT_ELEMS
    att.PAST_SEGMENT_ELEMS = 1024 * d  # three past segments per head
    try:
        fused = router._dense_flash(0, q, past, 0.3)
    finally:
        att.PAST_SEGMENT_ELEMS = old
    tiled = router._dense_tiled(0, q, past, 0.3)
    assert (fused - tiled).abs().max().item() < 1e-5
    assert fused.transpose(0, 1).is_contiguous()  # [L, Hq, d]


@pytest.mark.parametrize("positions", ["AS_IS", "COMPACT"])
@pytest.mark.parametrize("window,init", [(1000, 32), (1000, 0), (2990, 32), (5000, 32)])
def test_windowed_prefill_attends_init_and_the_last_window(window, init, positions):
    """With prefill_window W, a chunk starting at `past` attends the first init_len tokens, the
    W before it and itself (causal), by both prefill paths; a window that reaches the start is
    the exact attention. With block_positions COMPACT the first tokens' keys are read as the
    ones just before the window: rotated on by past - W - init positions."""
    from types import SimpleNamespace

    import ktlong.attention as att
    from ktlong.kvstore import KVStore, StoreShape

    Hq, Hkv, d, past, chunk = 8, 2, 16, 3000, 700
    store = KVStore(StoreShape(1, Hkv, d, 16, "FP32", 1), past + chunk)
    g = torch.Generator().manual_seed(1)
    k = torch.randn(Hkv, past + chunk, d, generator=g)
    v = torch.randn(Hkv, past + chunk, d, generator=g)
    store.write(0, k, v)
    inv_freq = 10000.0 ** (-np.arange(0, d, 2) / d)  # [d/2] float64
    policy = SimpleNamespace(inv_freq=inv_freq, s=SimpleNamespace(
        prefill="WINDOW", prefill_window=window, init_len=init, block_positions=positions))
    router = att.AttentionRouter(store, policy, torch.device("cpu"))
    q = torch.randn(Hq, chunk, d, generator=g)
    kpos, qpos = torch.arange(past + chunk), past + torch.arange(chunk)
    apart = past - window > init
    seen = (kpos[None] <= qpos[:, None]) & ((kpos[None] < init) | (kpos[None] >= past - window)
                                            | (not apart))
    kread = k.clone()
    if positions == "COMPACT" and apart and init:  # rotate-half RoPE by angle turn * inv_freq
        ang = torch.from_numpy(np.concatenate([inv_freq, inv_freq]) * (past - window - init))
        x = k[:, :init].double()
        half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
        kread[:, :init] = (x * ang.cos() + half * ang.sin()).float()
    kr, vr = kread.repeat_interleave(Hq // Hkv, 0), v.repeat_interleave(Hq // Hkv, 0)
    want = torch.nn.functional.scaled_dot_product_attention(
        q[None], kr[None], vr[None], attn_mask=seen, scale=0.3)[0]  # [Hq, L, d]
    old = att.PAST_SEGMENT_ELEMS
    att.PAST_SEGMENT_ELEMS = 1024 * d  # several past segments per head
    try:
        fused = router._dense_flash(0, q, past, 0.3)  # [L, Hq, d] memory, [Hq, L, d] view
    finally:
        att.PAST_SEGMENT_ELEMS = old
    tiled = router._dense_tiled(0, q, past, 0.3)
    assert (fused - want).abs().max().item() < 1e-5
    assert (tiled - want).abs().max().item() < 1e-5


def test_captured_queries_hold_only_their_own_rows():
    """The prompt's last queries (DYNAMIC anchors, preselection votes) are copies of just those
    rows, equal to the queries a one-shot prefill captures: a view would keep each layer's whole
    chunk of queries alive through the prefill."""
    lm = load_model(hf_model("llama"), device="CPU", dtype="float32")
    ids = _prompt(lm.tokenizer, 1000)
    got = {}
    for chunk in (320, 1000):  # chunked (the window spans two chunks: 1000 % 320 < 64), one shot
        s = Session(lm, settings(anchor_type="DYNAMIC", chunk_size=chunk))
        assert s.policy.wants_votes()
        s.prefill(ids)
        got[chunk] = s.router.captured
    window = settings().preselect_window
    for layer, q in got[320].items():
        assert q.shape == (lm.spec.n_heads, window, lm.spec.head_dim)
        assert q.untyped_storage().nbytes() == q.numel() * q.element_size()
        assert torch.allclose(q, got[1000][layer], atol=1e-5)


def test_layer_major_prefill_equals_chunk_major():
    """CUDA prefills layer-major (one layer's KV mirrored on the device), the CPU chunk-major;
    run both orders on the CPU: same logits, same KV store."""
    lm = load_model(hf_model("llama"), device="CPU", dtype="float32")
    ids = _prompt(lm.tokenizer, 1000)
    a = Session(lm, settings(attention="DENSE", chunk_size=256))
    la = a.prefill(ids, all_logits=True)
    b = Session(lm, settings(attention="DENSE", chunk_size=256))
    b._chunk_major = b._layer_major  # what _forward picks on CUDA
    lb = b.prefill(ids, all_logits=True)
    assert la.shape == lb.shape == (1000, lm.model.config.vocab_size)
    assert torch.allclose(la, lb, atol=1e-5)
    for layer in range(lm.spec.n_layers):
        ka, va = a.store.token_range(layer, 0, 1000)
        kb, vb = b.store.token_range(layer, 0, 1000)
        assert torch.allclose(ka, kb, atol=1e-5) and torch.allclose(va, vb, atol=1e-5)
