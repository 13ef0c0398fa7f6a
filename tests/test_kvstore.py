"""The KV store's formats and tiers: Q8_0 / Q4_0 rows (bit-equal to the NumPy reference, within
their error bounds), the disk tier (a file no one else can see, reserved up front), and a store
that reads back what was written in every format and tier."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import torch
from ktlong.kernels import kvquant

from ktlong import kernels
from ktlong.errors import KtlongError
from ktlong.kvstore import KV_TYPES, KVStore, StoreShape, from_storage, row_elems, to_storage
from ktlong.memory import kv_row_bytes

QUANT = {"Q8_0": kvquant.Q8_0, "Q4_0": kvquant.Q4_0}


def _values(rng, shape, scale=1.0):
    x = rng.standard_normal(shape).astype(np.float32) * scale
    x[..., 5] *= 40  # an outlier channel, as real keys have
    return x


@pytest.mark.parametrize("kv_type", QUANT)
@pytest.mark.parametrize("d", [32, 64, 128])
def test_store_encoder_equals_the_numpy_reference_bit_for_bit(kv_type, d):
    rng = np.random.default_rng(d)
    x = _values(rng, (3, 50, d), scale=rng.uniform(1e-3, 1e3))
    x[0, 0] = 0.0  # an all-zero row: scale 0, codes 0
    got = to_storage(torch.from_numpy(x), kv_type)
    want = kernels.f32_to_kv(x, QUANT[kv_type])
    assert got.dtype == np.uint8 and got.shape == (3, 50, kv_row_bytes(kv_type, d))
    np.testing.assert_array_equal(got, want)
    back = from_storage(got, kv_type).numpy()
    np.testing.assert_array_equal(back, kernels.kv_to_f64(want, QUANT[kv_type]).astype(np.float32))
    assert np.all(back[0, 0] == 0)


@pytest.mark.parametrize("kv_type, steps, within", [("Q8_0", 127, 0.5), ("Q4_0", 8, 1.0)])
def test_round_trip_error_is_within_a_step_of_each_block(kv_type, steps, within):
    """|x - x'| <= half a step (Q8_0), one step (Q4_0: values of the sign opposite the block's
    largest clip at +7) plus the float16 rounding of the scale, and the block's largest value is
    kept to float16 precision."""
    rng = np.random.default_rng(7)
    x = _values(rng, (4, 200, 128))
    back = from_storage(to_storage(torch.from_numpy(x), kv_type), kv_type).numpy()
    blocks, bb = x.reshape(-1, 32), back.reshape(-1, 32)
    amax = np.abs(blocks).max(1, keepdims=True)
    step = amax / steps
    assert np.all(np.abs(blocks - bb) <= step * (within + 0.01) + 1e-7)
    i = np.abs(blocks).argmax(1)
    top, top_back = blocks[np.arange(len(i)), i], bb[np.arange(len(i)), i]
    np.testing.assert_allclose(top_back, top, rtol=2e-3)
    rms = np.sqrt(((blocks - bb) ** 2).mean() / (blocks ** 2).mean())
    assert rms < (0.02 if kv_type == "Q8_0" else 0.2)  # a wrong code or scale gives ~1


def test_two_round_trips_change_nothing():
    """Re-encoding decoded rows gives the same bytes (a cache converted twice does not drift)."""
    x = _values(np.random.default_rng(3), (2, 64, 64))
    for kv_type in QUANT:
        once = to_storage(torch.from_numpy(x), kv_type)
        np.testing.assert_array_equal(to_storage(from_storage(once, kv_type), kv_type), once)


@pytest.mark.parametrize("kv_type", list(KV_TYPES))
def test_memcheck_sizes_rows_as_the_store_does(kv_type):
    """memory.kv_row_bytes (kept free of the kernels' import) equals the kernels' row format."""
    for d in (32, 64, 96, 128, 256):
        assert kv_row_bytes(kv_type, d) == kvquant.row_bytes(KV_TYPES[kv_type][2], d)


def test_a_head_dim_that_is_not_whole_blocks_is_refused_in_one_line():
    with pytest.raises(KtlongError, match="multiple of 32.*80"):
        KVStore(StoreShape(1, 1, 80, 16, "Q8_0", 1), 64)


def _fill(store, rng, n):
    s = store.shape
    ks, vs = [], []
    for layer in range(s.n_layers):
        k = torch.from_numpy(_values(rng, (s.n_kv_heads, n, s.head_dim)))
        v = torch.from_numpy(_values(rng, (s.n_kv_heads, n, s.head_dim)))
        store.write(layer, k[:, : n // 2], v[:, : n // 2])
        store.write(layer, k[:, n // 2 :], v[:, n // 2 :])
        ks.append(k)
        vs.append(v)
    return ks, vs


@pytest.mark.parametrize("kv_type", list(KV_TYPES))
@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_decode_steps_store_each_token_as_the_bulk_write_does(kv_type, tier, tmp_path):
    """write_f32 (one token, one kernel call for FP32 / BF16) across block borders equals the
    same tokens written in bulk, ties rounded to even included; a full store refuses in one line."""
    shape = StoreShape(2, 2, 64, 16, kv_type, 1)
    step = KVStore(shape, 40, tier_dir=tmp_path / "tier" if tier == "disk" else None)
    bulk = KVStore(shape, 40)
    rng = np.random.default_rng(4)
    k = _values(rng, (2, 40, 64))
    v = _values(rng, (2, 40, 64))
    k[0, 3, :4] = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x3F807FFF], np.uint32).view(
        np.float32)  # bfloat16 ties (to even: down, up), a negative tie, just under a tie
    for layer in range(2):
        bulk.write(layer, torch.from_numpy(k), torch.from_numpy(v))
        for t in range(40):
            assert step.write_f32(layer, k[:, t], v[:, t]) == t
        for a, b in zip(step.row_range(layer, 0, 40), bulk.row_range(layer, 0, 40), strict=True):
            np.testing.assert_array_equal(a, b)
    if kv_type == "BF16":
        np.testing.assert_array_equal(step.row_range(0, 3, 4)[0][0, 0, :4],
                                      [0x3F80, 0x3F82, 0xBF80, 0x3F80])
    with pytest.raises(KtlongError, match="max_seq_len is 40"):
        step.write_f32(0, k[:, 0], v[:, 0])
    assert step.lengths[0] == 40


@pytest.mark.parametrize("kv_type", list(KV_TYPES))
@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_store_reads_back_what_it_wrote(kv_type, tier, tmp_path):
    shape = StoreShape(2, 2, 64, 16, kv_type, 1)
    store = KVStore(shape, 300, tier_dir=tmp_path / "tier" if tier == "disk" else None)
    ks, vs = _fill(store, np.random.default_rng(1), 250)
    for layer in range(2):
        k, v = store.token_range(layer, 10, 240)
        want_k = from_storage(to_storage(ks[layer][:, 10:240], kv_type), kv_type)
        torch.testing.assert_close(k, want_k, rtol=0, atol=0)
        rows_k, _ = store.row_range(layer, 0, 250)
        assert rows_k.shape == (2, 250, row_elems(kv_type, 64))
        np.testing.assert_array_equal(rows_k, to_storage(ks[layer], kv_type))
        assert torch.equal(v, from_storage(to_storage(vs[layer][:, 10:240], kv_type), kv_type))
    assert store.nbytes_used() == 250 * 2 * 2 * 2 * kv_row_bytes(kv_type, 64)
    if tier == "disk":
        assert store.mapped and not any((tmp_path / "tier").iterdir())  # unlinked at once


def test_decode_attention_over_the_disk_tier_equals_ram(tmp_path):
    shape = StoreShape(1, 2, 128, 16, "Q4_0", 1)
    ram, disk = KVStore(shape, 512), KVStore(shape, 512, tier_dir=tmp_path)
    for s in (ram, disk):
        _fill(s, np.random.default_rng(4), 400)
    q = np.random.default_rng(5).standard_normal((8, 128)).astype(np.float32)
    blocks = np.array([[0, 3, 7, 24]], np.int32)
    a = kernels.attend_layer(ram.kernel_views(0)[0], q, blocks, 400, 0.1)
    b = kernels.attend_layer(disk.kernel_views(0)[0], q, blocks, 400, 0.1)
    np.testing.assert_array_equal(a[0], b[0])


def test_a_disk_tier_that_does_not_fit_is_refused_in_one_line(tmp_path, monkeypatch):
    def full(fd, off, n):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(KtlongError, match="disk tier needs .* GB") as e:
        KVStore(StoreShape(2, 2, 64, 16, "Q8_0", 1), 4096, tier_dir=tmp_path)
    assert "free disk space" in e.value.hint
    assert not any(tmp_path.iterdir())  # nothing left behind


def test_a_killed_process_leaves_no_tier_file(tmp_path):
    """The tier's file has no name from the moment it is mapped: kill -9 leaves nothing that a
    later run could read as a half-written tier."""
    import subprocess
    import sys
    code = ("import sys, time; from pathlib import Path; "
            "from ktlong.kvstore import KVStore, StoreShape; "
            "s = KVStore(StoreShape(2, 2, 64, 16, 'Q8_0', 1), 4096, tier_dir=Path(sys.argv[1])); "
            "print('ready', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        assert list(tmp_path.iterdir()) == []
    finally:
        p.kill()
        p.wait()
    assert list(tmp_path.iterdir()) == []


def test_prefetch_asks_for_the_chosen_head_blocks_in_merged_runs(tmp_path, monkeypatch):
    shape = StoreShape(2, 2, 64, 16, "Q8_0", 1)
    store = KVStore(shape, 640, tier_dir=tmp_path)
    asked = []
    monkeypatch.setattr(store.tier, "prefetch", lambda runs: asked.extend(runs))
    store.prefetch(1, np.array([[3, 4, 5, 9]], np.int32))
    blk = 16 * kv_row_bytes("Q8_0", 64)  # one head-block of K
    nb_tail = store.k_tail[1].shape[1]
    ko, vo = store._tier_off[1]
    want = [(base + (j * nb_tail + b) * blk, n * blk)
            for j in range(2) for b, n in ((3, 3), (9, 1)) for base in (ko, vo)]
    assert sorted(asked) == sorted(want)
    # the runs are where the kernels read: K of head 1, block 9
    assert ko + (nb_tail + 9) * blk == (store.k_tail[1][1, 9].ctypes.data
                                        - store.k_tail[0].ctypes.data + store._tier_off[0][0])
    ram = KVStore(shape, 640)
    ram.prefetch(0, np.array([[1]], np.int32))  # a RAM tail: nothing to do, no error


def test_a_chat_on_the_disk_tier_answers_as_in_ram(tmp_path):
    """The same document and question, kv_tier RAM and DISK: the same tokens (the disk tier
    chooses, prefetches and attends in three calls instead of one)."""
    from ktlong.engine import Sampling, Session
    from ktlong.model import load_model
    from ktlong.tinymodel import filler_text

    from .models import hf_model, settings

    lm = load_model(hf_model("llama", head_dim=32), device="CPU", dtype="float32")
    ids = lm.tokenizer(filler_text(700, seed=3))["input_ids"][:700]
    answers = []
    for tier in ("RAM", "DISK"):
        st = settings(kv_type="Q4_0", kv_tier=tier, cache_dir=str(tmp_path), max_seq_len=1024)
        s = Session(lm, st)
        assert (s.store.tier is not None) == (tier == "DISK")
        s.prefill(ids)
        answers.append([x.token_id for x in s.generate(Sampling(max_new_tokens=10))])
        assert s.policy.attended_share() < 0.6  # the steps did choose blocks
    assert answers[0] == answers[1]


def test_tier_clear_reads_zeros_and_punches_whole_pages(tmp_path, monkeypatch):
    import mmap

    from ktlong import kvstore

    store = KVStore(StoreShape(1, 1, 64, 16, "Q8_0", 1), 8192, tier_dir=tmp_path)
    m, page = store.tier.mmap, mmap.PAGESIZE
    m[:] = b"\x07" * len(m)
    punched = []
    real = kvstore._punch
    monkeypatch.setattr(kvstore, "_punch", lambda mm, a, n: (punched.append((a, n)),
                                                             real(mm, a, n)))
    store.tier.clear(100, 3 * page + 10)
    assert m[99] == 7 and m[3 * page + 10] == 7
    assert m[100:3 * page + 10] == bytes(3 * page + 10 - 100)
    assert punched == [(page, 2 * page)]  # only the whole pages inside the range
    store.tier.clear(5, 50)  # within one page: zeroed, nothing punched
    assert m[5:50] == bytes(45) and len(punched) == 1


def test_a_saved_document_on_the_disk_tier_is_read_from_its_cache_entry(tmp_path, monkeypatch):
    """After the prompt cache saves a document prefilled on the disk tier, the store reads the
    entry and gives back the tier's copy: the same answers, and the cleared bytes cover the
    document's blocks."""
    from ktlong.engine import Sampling
    from ktlong.kvstore import TierFile
    from ktlong.model import load_model
    from ktlong.promptcache import open_document
    from ktlong.tinymodel import filler_text

    from .models import hf_model, settings

    lm = load_model(hf_model("llama", head_dim=32), device="CPU", dtype="float32")
    ids = lm.tokenizer(filler_text(700, seed=3))["input_ids"][:700]
    cleared = []
    real_clear = TierFile.clear
    monkeypatch.setattr(TierFile, "clear",
                        lambda self, a, b: (cleared.append(b - a), real_clear(self, a, b)))
    answers, stores = [], []
    for tier in ("RAM", "DISK"):
        st = settings(kv_type="Q8_0", kv_tier=tier, cache_dir=str(tmp_path / tier),
                      max_seq_len=1024)
        opened = open_document(lm, st, ids)
        s = opened.session
        stores.append(s.store)
        assert opened.entry is not None and opened.source == "prefill"
        answers.append([x.token_id for x in s.generate(Sampling(max_new_tokens=10))])
    ram, disk = stores
    assert disk.nb_base == (700 - 1) // 16 and ram.nb_base == 0
    for layer in range(ram.shape.n_layers):
        torch.testing.assert_close(disk.token_range(layer, 0, 710), ram.token_range(layer, 0, 710),
                                   rtol=0, atol=0)
    assert answers[0] == answers[1]
    doc = disk.nb_base * disk.block_bytes * disk.shape.n_layers  # K + V of the saved blocks
    assert sum(cleared) >= doc  # their bytes in the tier (and the unused room) were given back


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def test_a_short_document_does_not_take_a_huge_page_per_head():
    """Each (layer, K/V, head) region is sized for max_seq_len; its first token must not bring in
    a 2 MB page (8 layers x 2 x 8 heads x 2 MB = 256 MB for a few KB of KV). Past HUGE_REGION
    bytes a region asks for 2 MB pages again."""
    from ktlong import kvstore

    shape = StoreShape(8, 8, 128, 128, "BF16", 1)
    before = _rss_anon()
    store = KVStore(shape, 131072)  # 32 MB per head region
    rows = np.ones((8, 100, 128), np.uint16)
    for layer in range(8):
        store.write_rows(layer, rows, rows)
    grown = _rss_anon() - before
    assert grown < 40 << 20, f"{grown >> 20} MB for 100 tokens"
    assert not any(store._huge)
    more = np.ones((8, kvstore.HUGE_REGION // 256, 128), np.uint16)  # fills 8 MB a region
    store.write_rows(0, more, more)
    assert store._huge[0] and not store._huge[1]
    k, _ = store.token_range(0, 90, 110)
    assert torch.equal(k, from_storage(np.ones((8, 20, 128), np.uint16), "BF16"))
