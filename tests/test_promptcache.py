"""The on-disk prompt cache: hits equal fresh prefills, and no damaged entry is ever used."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ktlong import kernels
from ktlong.engine import Sampling
from ktlong.errors import KtlongError
from ktlong.model import load_model
from ktlong.promptcache import (
    ALIGN,
    MAGIC,
    SUFFIX,
    load_conversation,
    open_cache,
    open_document,
    read_header,
    save_conversation,
)
from ktlong.tinymodel import filler_text

from .models import hf_model, settings


@pytest.fixture(scope="module")
def lm():
    return load_model(hf_model("llama", qk_scale=4.0), device="CPU", dtype="float32")


def _ids(lm, n, seed=5):
    return lm.tokenizer(filler_text(n, seed=seed))["input_ids"][:n]


def _answer(session, n=12):
    """A question appended (as the chat does after opening a document), then n tokens."""
    session.extend_to(list(session.tokens) + _ids(session.lm, 9, seed=11))
    return [s.token_id for s in session.generate(Sampling(max_new_tokens=n))]


@pytest.mark.parametrize("kv_type", ["FP32", "BF16", "FP16"])
@pytest.mark.parametrize("n", [1200, 1200 - 1200 % 16])  # a partial last block, and none
def test_cache_hit_decodes_like_the_fresh_prefill(lm, kv_type, n, tmp_path):
    """The question after a cached document gets the same logits, bit for bit, and the same
    answer as after the document's own prefill (an entry is opened as it is: its last token is
    not fed again, which would recompute its row alone)."""
    st = settings(kv_type=kv_type, anchor_type="MEAN")
    ids = _ids(lm, n)
    first = open_document(lm, st, ids, cache_dir=tmp_path)
    assert first.source == "prefill" and first.entry.exists()
    again = open_document(lm, st, ids, cache_dir=tmp_path)
    assert again.source == "cache" and again.entry == first.entry
    assert again.session.store.nb_base > 0  # the KV really comes from the mapped file
    assert isinstance(again.session.store.k_base[0], np.memmap)
    assert again.session.logits is None  # nothing recomputed: the question brings the logits
    question = ids + _ids(lm, 9, seed=11)
    first.session.extend_to(question)
    again.session.extend_to(question)
    assert torch.equal(again.session.logits, first.session.logits)
    assert _answer(again.session) == _answer(first.session)


def test_entry_serves_any_conversation_that_starts_with_the_document(lm, tmp_path):
    st = settings(anchor_type="MEAN")
    doc, question = _ids(lm, 1000), _ids(lm, 40, seed=6)
    open_document(lm, st, doc, cache_dir=tmp_path)
    hit = open_document(lm, st, doc + question, cache_dir=tmp_path)
    assert hit.source == "cache" and len(hit.session.tokens) == 1040
    cold = open_document(lm, st, doc + question, use_cache=False)
    assert _answer(hit.session) == _answer(cold.session)


def test_selection_settings_do_not_invalidate_but_kv_settings_do(lm, tmp_path):
    ids = _ids(lm, 800)
    open_document(lm, settings(anchor_type="MEAN"), ids, cache_dir=tmp_path)
    other_policy = settings(anchor_type="MEAN", second_select_num=3, token_step=2)
    assert open_document(lm, other_policy, ids, cache_dir=tmp_path).source == "cache"
    bf16 = open_document(lm, settings(kv_type="BF16"), ids, cache_dir=tmp_path)
    assert bf16.source == "cache" and "converted the cached FP32 KV to BF16" in bf16.note
    windowed = settings(anchor_type="MEAN", prefill_window=256)  # other KV: its own entry
    assert open_document(lm, windowed, ids, cache_dir=tmp_path).source == "prefill"
    assert open_document(lm, windowed, ids, cache_dir=tmp_path).source == "cache"
    assert (
        open_document(lm, settings(block_size=32, init_len=32), ids, cache_dir=tmp_path).source
        == "prefill"
    )


def test_anchors_of_the_other_score_positions_are_taken_again(lm, tmp_path):
    """An entry records whether its anchors are of keys turned back to position 0 (NEAR): opened
    with the other setting, it still serves the KV, its anchors are taken afresh, and the answer
    equals that of a fresh prefill under the setting in force."""
    ids = _ids(lm, 1500)
    near = settings(anchor_type="MAX", second_select_num=3, score_positions="NEAR")
    first = open_document(lm, near, ids, cache_dir=tmp_path)
    assert read_header(first.entry)[0]["anchor_type"] == "MAX:NEAR"
    as_is = settings(anchor_type="MAX", second_select_num=3)
    again = open_document(lm, as_is, ids, cache_dir=tmp_path)
    cold = open_document(lm, as_is, ids, use_cache=False)
    assert again.source == "cache"
    assert _answer(again.session) == _answer(cold.session)  # both take their anchors
    want = _answer(first.session)
    nb = again.session.store.nb_base
    for layer, got in enumerate(again.session.store.anchors):
        np.testing.assert_array_equal(got[:, :nb], cold.session.store.anchors[layer][:, :nb])
        assert not np.array_equal(got[:, :nb], first.session.store.anchors[layer][:, :nb])
    hit = open_document(lm, near, ids, cache_dir=tmp_path)
    for layer, got in enumerate(hit.session.store.anchors):  # read from the entry
        np.testing.assert_array_equal(got[:, :nb], first.session.store.anchors[layer][:, :nb])
    assert _answer(hit.session) == want


@pytest.fixture(scope="module")
def lm32():
    """head_dim 32: whole Q8_0 / Q4_0 blocks."""
    return load_model(hf_model("llama", head_dim=32), device="CPU", dtype="float32")


@pytest.mark.parametrize("kv_type", ["Q8_0", "Q4_0"])
def test_quantised_kv_is_cached_in_its_own_format(lm32, kv_type, tmp_path):
    st = settings(kv_type=kv_type, anchor_type="MEAN")
    ids = _ids(lm32, 1000, seed=7)  # (seeds 5, 6: the hit's re-fed last token flips a near-tie)
    first = open_document(lm32, st, ids, cache_dir=tmp_path)
    fresh = _answer(first.session)
    row = first.session.store.row
    # 32 codes (16 bytes of nibbles) + a float16 scale, padded to 4 bytes
    assert first.session.store.k_tail[0].dtype == np.uint8 and row == (36 if kv_type == "Q8_0"
                                                                        else 20)
    again = open_document(lm32, st, ids, cache_dir=tmp_path)
    assert again.source == "cache" and again.session.store.k_base[0].shape[-1] == row
    for layer in range(2):  # the mapped blocks hold the prefill's bytes
        np.testing.assert_array_equal(again.session.store.row_range(layer, 0, 992)[0],
                                      first.session.store.row_range(layer, 0, 992)[0])
    assert _answer(again.session) == fresh


def test_a_cache_in_another_kv_type_is_converted_once_then_hit(lm32, tmp_path):
    ids = _ids(lm32, 900)
    bf16 = open_document(lm32, settings(kv_type="BF16", anchor_type="MEAN"), ids,
                         cache_dir=tmp_path)
    q8 = settings(kv_type="Q8_0", anchor_type="MEAN")
    conv = open_document(lm32, q8, ids, cache_dir=tmp_path)
    assert conv.source == "cache" and "converted the cached BF16 KV to Q8_0" in conv.note
    src, dst = bf16.session.store, conv.session.store
    for layer in range(2):  # the BF16 values, quantised: nothing recomputed
        want = kernels.f32_to_kv(src.token_range(layer, 0, 896)[0].numpy(), 3)
        np.testing.assert_array_equal(dst.row_range(layer, 0, 896)[0], want)
        np.testing.assert_array_equal(dst.anchors[layer][:, :56], src.anchors[layer][:, :56])
    hit = open_document(lm32, q8, ids, cache_dir=tmp_path)  # saved in Q8_0 as well
    assert hit.source == "cache" and hit.note == "" and hit.entry != bf16.entry
    assert _answer(hit.session) == _answer(conv.session)


def _entry(tmp_path):
    (path,) = (tmp_path / "entries").glob(f"*{SUFFIX}")
    return path


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "version", "garbage"])
def test_damaged_entry_is_reported_and_recomputed(lm, tmp_path, damage):
    st = settings(anchor_type="MEAN")
    ids = _ids(lm, 900)
    fresh = _answer(open_document(lm, st, ids, cache_dir=tmp_path).session)
    path = _entry(tmp_path)
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) - 5000]
    elif damage == "bitflip":
        raw[len(raw) // 2] ^= 0x10
    elif damage == "version":
        raw[8] = 99
    else:
        raw[:8] = b"NOTKTLNG"
    path.write_bytes(bytes(raw))
    opened = open_document(lm, st, ids, cache_dir=tmp_path)
    if damage in ("version", "garbage"):  # unreadable headers never match a lookup
        assert opened.source == "prefill"
    else:
        assert opened.source == "prefill" and "damaged" in opened.note
    assert _answer(opened.session) == fresh
    read_header(_entry(tmp_path))  # a good entry was written back


def test_a_truncated_entry_of_another_kv_type_is_not_converted(lm32, tmp_path):
    ids = _ids(lm32, 700)
    open_document(lm32, settings(kv_type="BF16", anchor_type="MEAN"), ids, cache_dir=tmp_path)
    path = _entry(tmp_path)
    path.write_bytes(path.read_bytes()[:-5000])
    q4 = settings(kv_type="Q4_0", anchor_type="MEAN", kv_tier="DISK", cache_dir=str(tmp_path))
    opened = open_document(lm32, q4, ids, cache_dir=tmp_path)
    assert opened.source == "prefill" and "damaged" in opened.note and not path.exists()
    assert opened.session.store.tier is not None and opened.session.store.row == 20
    assert read_header(_entry(tmp_path))[0]["content"]["kv_type"] == "Q4_0"


def _rewrite_as_version_1(path: Path) -> None:
    """Rewrite a cache entry in format 1 (what ktlong wrote before Q8 anchors): BF16 anchors
    [Hkv, nb, A, d] in place of the Q8 rows [Hkv, nb, A, d + 4], CRCs and version to match."""
    import json
    import struct
    import zlib

    header, offset = read_header(path)
    raw = path.read_bytes()
    L, H, d = header["content"]["shape"]
    item = {"FP32": 4, "BF16": 2, "FP16": 2}[header["content"]["kv_type"]]
    nb, A, rem = header["n_blocks"], header["anchor_num"], header["remainder"]
    bs = header["content"]["block_size"]
    al = lambda n: -(-n // ALIGN) * ALIGN  # noqa: E731
    kv, q8, rm = H * nb * bs * d * item, H * nb * A * (d + 4), H * rem * d * item
    o = offset + al(header["n_tokens"] * 4)
    out, crcs = [raw[:o]], []
    for _ in range(L):
        kvs = raw[o:o + 2 * al(kv)]
        q = np.frombuffer(raw, np.uint8, q8, o + 2 * al(kv)).reshape(H, nb, A, d + 4)
        bf = kernels.f32_to_kv(kernels.anchors_to_f64(q).astype(np.float32), 1).tobytes()
        bf += bytes(al(len(bf)) - len(bf))
        rems = raw[o + 2 * al(kv) + al(q8):o + 2 * al(kv) + al(q8) + 2 * al(rm)]
        crcs.append(zlib.crc32(rems, zlib.crc32(bf, zlib.crc32(kvs))))
        out += [kvs, bf, rems]
        o += 2 * al(kv) + al(q8) + 2 * al(rm)
    del header["version"]
    header["layer_crc"] = crcs
    js = json.dumps(header).encode()
    body = b"".join(out)
    path.write_bytes(MAGIC + struct.pack("<IQ", 1, len(js)) + js + body[20 + len(js):])


def test_entry_of_format_1_is_read_with_its_anchors_converted(lm, tmp_path):
    """Entries written before Q8 anchors (BF16 anchors, format 1) still serve: their anchors are
    converted, not recomputed, so the chat starts at once and answers as before."""
    st = settings(anchor_type="MAX", second_select_num=3)  # few blocks: anchors decide
    ids = _ids(lm, 1500)
    first = open_document(lm, st, ids, cache_dir=tmp_path)
    fresh = _answer(first.session)
    path = first.entry
    _rewrite_as_version_1(path)
    assert read_header(path)[0]["version"] == 1
    again = open_document(lm, st, ids, cache_dir=tmp_path)
    assert again.source == "cache" and again.entry == path
    nb = again.session.store.nb_base
    for layer, got in enumerate(again.session.store.anchors):
        q8 = first.session.store.anchors[layer][:, :nb]
        bf = kernels.f32_to_kv(kernels.anchors_to_f64(q8).astype(np.float32), 1)
        np.testing.assert_array_equal(
            got[:, :nb], kernels.q8_encode(kernels.kv_to_f64(bf, 1).astype(np.float32)))
    assert _answer(again.session) == fresh


def test_other_model_entry_is_not_used(lm, tmp_path):
    ids = _ids(lm, 700)
    open_document(lm, settings(), ids, cache_dir=tmp_path)
    other = load_model(hf_model("llama", qk_scale=2.0), device="CPU", dtype="float32")
    assert open_document(other, settings(), ids, cache_dir=tmp_path).source == "prefill"
    assert len(list((tmp_path / "entries").glob(f"*{SUFFIX}"))) == 2


def test_full_disk_keeps_the_chat_and_leaves_no_partial_entry(lm, tmp_path, monkeypatch):
    import ktlong.promptcache as pc

    real_open = open

    class FullDisk:
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, b):
            self.n += len(b)
            if self.n > 20000:
                raise OSError(28, "No space left on device")
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

    def fake_open(path, mode="r", *a, **k):
        f = real_open(path, mode, *a, **k)
        return FullDisk(f) if "w" in mode and ".tmp-" in str(path) else f

    monkeypatch.setattr(pc, "open", fake_open, raising=False)
    opened = open_document(lm, settings(), _ids(lm, 900), cache_dir=tmp_path)
    assert opened.source == "prefill" and "No space left" in opened.note
    assert list((tmp_path / "entries").iterdir()) == []  # no partial, no temp file
    assert len(_answer(opened.session, 3)) >= 1  # the chat goes on


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_kill_during_write_leaves_nothing_that_loads(lm, tmp_path, sig):
    """A writer killed mid-write leaves no entry: SIGKILL only a temp file, which is never
    opened and is removed by the next writer; SIGINT (Ctrl-C) not even that."""
    script = textwrap.dedent(f"""
        import sys; sys.path.append({os.getcwd()!r})  # after site-packages (see test_warmup)
        import os, time, ktlong.promptcache as pc
        from ktlong.model import load_model
        from tests.models import hf_model, settings
        real = pc.write_entry.__globals__["zlib"].crc32
        def slow(*a):
            time.sleep(0.05)
            return real(*a)
        pc.zlib.crc32 = slow
        lm = load_model(hf_model("llama", qk_scale=4.0), device="CPU", dtype="float32")
        text = open({str(tmp_path / "doc.txt")!r}).read()
        ids = lm.tokenizer(text)["input_ids"][:900]
        print("start", flush=True)
        pc.open_document(lm, settings(), ids, cache_dir=pc.Path({str(tmp_path)!r}))
    """)
    (tmp_path / "doc.txt").write_text(filler_text(900, seed=5))
    p = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "start"
    deadline = time.time() + 120
    while time.time() < deadline and not list((tmp_path / "entries").glob("*.tmp-*")):
        time.sleep(0.05)
    assert list((tmp_path / "entries").glob("*.tmp-*")), "the writer never started"
    os.kill(p.pid, sig)
    p.wait()
    assert p.returncode != 0  # it did not finish the write
    left = list((tmp_path / "entries").glob("*.tmp-*"))
    assert len(left) == (sig == signal.SIGKILL)  # Ctrl-C: its own temp file removed at once
    assert list((tmp_path / "entries").glob(f"*{SUFFIX}")) == []
    ids = _ids(lm, 900)
    assert open_document(lm, settings(), ids, cache_dir=tmp_path).source == "prefill"
    assert list((tmp_path / "entries").glob("*.tmp-*")) == []  # cleaned after the writer died


def test_save_and_load_a_conversation(lm, tmp_path):
    st = settings(anchor_type="MEAN")
    s = open_document(lm, st, _ids(lm, 800), cache_dir=tmp_path).session
    s.extend_to(s.tokens + _ids(lm, 30, seed=9))
    save_conversation(s, "mychat", cache_dir=tmp_path, state={"turns": [1, 2]})
    expected = _answer(s)
    back, state = load_conversation(lm, st, "mychat", cache_dir=tmp_path)
    assert state == {"turns": [1, 2]}
    assert back.tokens == s.tokens[: len(back.tokens)] and _answer(back) == expected
    with pytest.raises(KtlongError, match="no saved conversation"):
        load_conversation(lm, st, "nope", cache_dir=tmp_path)


def test_lru_eviction_keeps_the_cache_under_its_cap(lm, tmp_path):
    st = settings(cache_max_gb=0.0)  # every older entry must go
    for seed in range(3):
        open_document(lm, st, _ids(lm, 500, seed=seed), cache_dir=tmp_path)
    entries = open_cache(st, tmp_path).entries()
    assert len(entries) == 1 and entries[0].header["n_tokens"] == 500


def test_inspect_cache_lists_and_removes_entries(lm, tmp_path):
    import json

    from typer.testing import CliRunner

    from ktlong.cli import app

    opened = open_document(lm, settings(), _ids(lm, 600), cache_dir=tmp_path)
    key = opened.entry.stem
    run = CliRunner().invoke(app, ["inspect", "cache", "--cache-dir", str(tmp_path), "--json"])
    assert run.exit_code == 0, run.output
    (row,) = json.loads(run.output)["entries"]
    assert row["key"] == key and row["tokens"] == 600 and row["bytes"] > 0
    run = CliRunner().invoke(app, ["inspect", "cache", "--cache-dir", str(tmp_path)],
                             env={"COLUMNS": "80"})
    assert run.exit_code == 0 and key[:8] in run.output and "600" in run.output
    assert "…" not in run.output and max(map(len, run.output.splitlines())) <= 80
    run = CliRunner().invoke(
        app, ["inspect", "cache", "--cache-dir", str(tmp_path), "--remove", key[:8]]
    )
    assert run.exit_code == 0 and f"removed {key}" in run.output
    assert not opened.entry.exists()
    run = CliRunner().invoke(
        app, ["inspect", "cache", "--cache-dir", str(tmp_path), "--remove", "zz"]
    )
    assert run.exit_code == 2 and "no prompt-cache entry matches" in run.output


def test_prefill_command_writes_the_entry_a_chat_then_maps(tmp_path):
    import json

    from typer.testing import CliRunner

    from ktlong.cli import app

    model = hf_model("llama", qk_scale=4.0)
    doc = tmp_path / "book.txt"
    doc.write_text(filler_text(700, seed=11))
    base = [
        "--model",
        str(model),
        "--prompt-file",
        str(doc),
        "--cache-dir",
        str(tmp_path / "c"),
        "--kv-type",
        "FP32",
        "--set",
        "max_seq_len=4096",
        "--set",
        "block_size=16",
        "--set",
        "init_len=16",
        "--set",
        "local_windows_len=64",
    ]
    run = CliRunner().invoke(app, ["prefill", *base, "--json"])
    assert run.exit_code == 0, run.output
    out = json.loads(run.output[run.output.index("{") :])  # after the progress bar (stderr)
    assert out["source"] == "prefill" and Path(out["entry"]).exists() and out["tokens"] > 700
    chat = CliRunner().invoke(
        app, ["chat", *base, "--question", "What is the key?", "--json", "--max-new-tokens", "4"]
    )
    assert chat.exit_code == 0, chat.output
    assert "from the prompt cache" in chat.output or '"source": "cache"' in chat.output
    missing = CliRunner().invoke(app, ["prefill", "--model", str(model)])
    assert missing.exit_code == 2 and "no document given" in missing.output


def test_extend_to_refuses_to_rewrite_the_mapped_prefix(lm, tmp_path):
    ids = _ids(lm, 800)
    open_document(lm, settings(), ids, cache_dir=tmp_path)
    hit = open_document(lm, settings(), ids, cache_dir=tmp_path).session
    changed = list(ids)
    changed[10] = (changed[10] + 1) % 100
    with pytest.raises(ValueError, match="read-only cached prefix"):
        hit.extend_to(changed)
    assert hit.tokens == ids  # nothing was cut or written


def test_mapped_pages_are_released_past_the_cap(tmp_path):
    """Reads through a mapped base stay resident (RSS) until released; the cap bounds them."""
    from ktlong.kvstore import KVStore, StoreShape, _file_rss

    H, nb, bs, d = 4, 512, 64, 64  # 16 MiB per array, uint16
    path = tmp_path / "kv.bin"
    rng = np.random.default_rng(0)
    rng.integers(0, 1 << 15, 2 * H * nb * bs * d, dtype=np.uint16).tofile(path)

    def sweep(cap: int) -> int:
        k = np.memmap(path, np.uint16, "r", 0, (H, nb, bs, d))
        v = np.memmap(path, np.uint16, "r", k.nbytes, (H, nb, bs, d))
        store = KVStore(StoreShape(1, H, d, bs, "BF16", 1), nb * bs + 64, base=([k], [v]))
        assert store.mapped
        store.map_cap = cap
        grew = 0
        for t0 in range(0, nb * bs, 2048):  # a dense sweep, segment by segment
            store.token_range(0, t0, t0 + 2048)
            grew = max(grew, _file_rss() - store._file_rss0)
        return grew

    total = 2 * H * nb * bs * d * 2
    assert sweep(1 << 62) > total // 2  # left mapped: RSS follows the file
    assert sweep(4 << 20) <= 4 << 20  # bounded: checked after each read


def test_other_mapped_files_do_not_keep_releasing_the_store(tmp_path):
    """Weights mapped after the store opened count once, not at every later check."""
    from ktlong.kvstore import KVStore, StoreShape

    H, nb, bs, d = 2, 64, 64, 64
    kv = tmp_path / "kv.bin"
    np.ones(2 * H * nb * bs * d, np.uint16).tofile(kv)
    k = np.memmap(kv, np.uint16, "r", 0, (H, nb, bs, d))
    v = np.memmap(kv, np.uint16, "r", k.nbytes, (H, nb, bs, d))
    store = KVStore(StoreShape(1, H, d, bs, "BF16", 1), nb * bs + 64, base=([k], [v]))
    store.map_cap = 1 << 20
    weights = tmp_path / "weights.bin"
    np.ones(16 << 20, np.uint8).tofile(weights)
    w = np.memmap(weights, np.uint8, "r")
    assert int(w[:: 4096].sum()) > 0  # 16 MB of another file now resident
    released = []
    store.release_mapped = lambda orig=store.release_mapped: (released.append(1), orig())
    for _ in range(5):
        store.token_range(0, 0, 64)
    assert len(released) == 1  # once, then the weights are part of the baseline


def test_decoding_with_released_pages_equals_the_fresh_prefill(lm, tmp_path):
    st = settings(kv_type="BF16", anchor_type="MEAN")
    ids = _ids(lm, 1500)
    first = open_document(lm, st, ids, cache_dir=tmp_path)
    fresh = _answer(first.session)
    again = open_document(lm, st, ids, cache_dir=tmp_path)
    assert again.source == "cache"
    again.session.store.map_cap = 0  # release after every layer of every step
    assert _answer(again.session) == fresh


def test_reading_mapped_bf16_prints_no_torch_warning():
    """A cache entry's K, V are mapped read-only; converting them must not print torch's
    non-writable-array warning (torch warns once per process, hence a fresh one)."""
    code = ("import warnings, numpy as np; warnings.simplefilter('error'); "
            "from ktlong.kvstore import from_storage; "
            "a = np.arange(8, dtype=np.uint16); a.flags.writeable = False; "
            "print(tuple(from_storage(a, 'BF16').shape))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "(8,)" and r.stderr == "", r.stderr
