"""SlidingKV (Gemma 3's sliding-window layers) against plain masked attention over every row."""
import numpy as np
import pytest
import torch

from ktlong import slidingkv
from ktlong.slidingkv import SlidingKV


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, window: int,
              scale: float) -> torch.Tensor:
    """q [Hq, L, d] at positions start.. over every key so far k, v [Hkv, start + L, d],
    in float64: a query at p reads keys p - window + 1 .. p."""
    g = q.shape[0] // k.shape[0]
    kk, vv = k.repeat_interleave(g, 0).double(), v.repeat_interleave(g, 0).double()
    qpos = torch.arange(start, start + q.shape[1])[:, None]
    kpos = torch.arange(k.shape[1])[None, :]
    s = (q.double() @ kk.transpose(1, 2)) * scale  # [Hq, L, start + L]
    s = s.masked_fill(~((kpos <= qpos) & (qpos - kpos < window)), float("-inf"))
    return torch.softmax(s, -1) @ vv


@pytest.mark.parametrize("window, chunks", [
    (16, [300, 1, 45, 1, 1]),  # window far below a query tile
    (512, [1000, 700, 3, 1]),  # Gemma 3's window: tiles of a chunk start inside the past rows
    (200, [129, 127, 256, 1]),  # chunks at and around the tile's edge
])
@pytest.mark.parametrize("kv_type, dtype", [("FP32", torch.float32), ("BF16", torch.bfloat16),
                                             ("FP16", torch.float16), ("Q8_0", torch.bfloat16)])
def test_attend_matches_masked_attention_over_every_row(window: int, chunks: list[int],
                                                        kv_type: str, dtype: torch.dtype) -> None:
    """Prefill chunks and decode steps over rows kept in the store's KV type (BF16 where the
    store quantises): exact attention over the rows as rounded to that type."""
    g = torch.Generator().manual_seed(window)
    hq, hkv, d, scale = 4, 2, 8, 0.3
    sw = SlidingKV((0,), hkv, d, window, kv_type)
    assert sw.kb[0].dtype == dtype
    ks, vs, pos = [], [], 0
    for n in chunks:
        q, k, v = (torch.randn(h, n, d, generator=g) for h in (hq, hkv, hkv))
        ks.append(k.to(dtype).float()), vs.append(v.to(dtype).float())
        if n == 1:  # a decode step
            got = torch.from_numpy(sw.attend_one(0, q[:, 0].numpy(), k[:, 0].numpy(),
                                                 v[:, 0].numpy(), scale))[:, None]
        else:
            got = sw.attend(0, q, k, v, scale)
        want = reference(q, torch.cat(ks, 1), torch.cat(vs, 1), pos, window, scale)
        np.testing.assert_allclose(got.double().numpy(), want.numpy(), atol=2e-5)
        pos += n
        assert sw.length(0) == pos and sw.first[0] <= max(0, pos - window)


def test_a_chunk_is_attended_in_query_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk longer than the tile takes several calls, each over tile + window - 1 keys at
    most, so the layer's work grows with the window, not with the chunk."""
    calls: list[tuple[int, int]] = []
    real = slidingkv.F.scaled_dot_product_attention

    def spy(q, k, v, mask, **kw):
        calls.append((q.shape[2], k.shape[2]))
        return real(q, k, v, mask, **kw)

    sw = SlidingKV((0,), 1, 4, 64)
    q = torch.randn(2, 1000, 4)
    kv = torch.randn(1, 1000, 4)
    monkeypatch.setattr(slidingkv.F, "scaled_dot_product_attention", spy)
    sw.attend(0, q, kv, kv, 0.5)
    tile = slidingkv.QUERY_TILE
    assert len(calls) == -(-1000 // tile)
    assert all(t <= tile and k <= t + 64 - 1 for t, k in calls)
