"""The on-disk prompt cache: prefill a document once, memory-map its KV on every later chat.

One entry is one file, `<key>.ktkv`, in the KV store's own layout so it maps straight back in:
  magic "KTLONGKV" | u32 version | u64 header length | JSON header | pad to 16 KiB |
  token ids int32 [n] | per layer: K, V [Hkv, nb, bs, row] of the full blocks (storage format:
  row = d values, or a quantised row's bytes), anchors Q8 [Hkv, nb, A, d + 4]
  (kernels/anchors.py; version 1: BF16 bits [Hkv, nb, A, d], still read), K, V [Hkv, rem, row]
  of the partial last block; then, for a model with sliding-window layers (Gemma 3), their last
  `window` rows, f32 [layers, 2, Hkv, window, d] (ktlong/slidingkv.py);
each section aligned to 4 KiB. The header names the model, tokenizer, kv_type, block_size and RoPE
(the key: everything that changes KV contents, nothing else), a CRC-32 per layer, checked on
load, and each layer's input/output cosine summed over the prefill (`layer_budget: SQUEEZE`;
an entry without it gives UNIFORM budgets). Entries are written to a temporary name, fsynced
and renamed, under a per-key lock; only complete `*.ktkv` files are ever opened. JSON + raw
arrays: no pickle, nothing in a file can run.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import mmap
import os
import struct
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ktlong.config import Settings, ktlong_home
from ktlong.engine import Progress, Session, check_fits, tier_dir
from ktlong.errors import KtlongError
from ktlong.kernels import Q8_EXTRA, kv_to_f64, q8_encode
from ktlong.kvstore import KV_TYPES, KVStore, StoreShape, row_elems
from ktlong.memory import stays_resident
from ktlong.minference import prefill_key
from ktlong.model import LoadedModel
from ktlong.spec import ModelSpec
from ktlong.weights import prefill_precision

MAGIC = b"KTLONGKV"
VERSION = 2  # written; 1 (BF16 anchors) is read too, its anchors converted
READABLE = (1, 2)
ALIGN = 4096
HEADER_ROOM = 4 * ALIGN  # the header's reserved room; data starts here
SUFFIX = ".ktkv"


class DamagedEntry(Exception):
    """A cache file that must not be used (truncated, corrupted, other model or version)."""


@dataclass
class Opened:
    session: Session
    source: str  # "cache" (memory-mapped entry) or "prefill"
    entry: Path | None = None  # the cache entry used or written
    note: str = ""  # one line for the user: a damaged entry recomputed, a write that failed
    verify_s: float = 0.0  # time spent checking the entry's checksums


def cache_root(settings: Settings, cache_dir: Path | None = None) -> Path:
    """The prompt cache folder (`cache_dir`, else the setting, else KTLONG_HOME/cache); refused
    in one line when it, or a folder above it, is a file."""
    root = Path(cache_dir or settings.cache_dir or ktlong_home() / "cache").expanduser()
    up = root
    while not up.exists() and up.parent != up:
        up = up.parent
    if up.exists() and not up.is_dir():
        what = "" if up == root else f" cannot be made: {up}"
        raise KtlongError(f"the prompt cache folder {root}{what} is a file, not a folder",
                          hint="pass --cache-dir a folder (or set cache_dir in config.yaml to "
                               "one), or move the file away")
    return root


def content_key(spec: ModelSpec, settings: Settings) -> dict[str, Any]:
    """Everything besides the token ids that changes the KV contents."""
    key = {
        "model": spec.fingerprint,
        "tokenizer": spec.tokenizer_fingerprint,
        "arch": spec.arch,
        "kv_type": settings.kv_type,
        "block_size": settings.block_size,
        "rope_theta": spec.rope_theta,
        "rope_scaling": spec.rope_scaling,
        "shape": [len(spec.kv_layers), spec.n_kv_heads, spec.head_dim],  # the store's layers
    }
    key.update(prefill_key(spec, settings))  # a windowed or sparse prefill makes other KV
    if settings.attention == "LOCRET":  # what was kept
        key["locret"] = locret_key(spec, settings)
    precision = prefill_precision(spec.hidden_size, settings.prefill_matmul)
    if precision != "FP32":  # BF16 or int8 products: other KV
        key["prefill_matmul"] = precision
    return key


def locret_key(spec: ModelSpec, s: Settings) -> dict[str, Any]:
    """What decides the tokens a LOCRET prefill keeps."""
    from ktlong import locret

    key: dict[str, Any] = {"budget": s.locret_budget, "stabilisers": s.locret_stabilisers,
                           "scores": s.locret_scores, "chunk": locret.chunk_len(s)}
    if s.locret_scores == "HEADS":
        key["heads"] = hashlib.sha256(locret.find_heads(spec, s).read_bytes()).hexdigest()[:16]
    if s.locret_scores in ("RECENT", "SURPRISE"):
        key["init_len"] = s.init_len
    return key


def _ids_hash(ids: list[int] | np.ndarray) -> str:
    return hashlib.sha256(np.asarray(ids, dtype=np.int32).tobytes()).hexdigest()


def entry_key(ck: dict[str, Any], ids: list[int] | np.ndarray) -> str:
    h = hashlib.sha256(json.dumps(ck, sort_keys=True).encode())
    h.update(_ids_hash(ids).encode())
    return h.hexdigest()[:24]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# --- reading -------------------------------------------------------------------------------------
def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """(header, data offset); raises DamagedEntry on anything unexpected."""
    try:
        with open(path, "rb") as f:
            head = f.read(20)
            if len(head) < 20 or head[:8] != MAGIC:
                raise DamagedEntry("not a ktlong cache file")
            version, n = struct.unpack("<IQ", head[8:])
            if version not in READABLE:
                raise DamagedEntry(f"cache format version {version}, this ktlong reads "
                                   f"{', '.join(map(str, READABLE))}")
            if n > 1 << 26:
                raise DamagedEntry("damaged header")
            header = json.loads(f.read(n))
            header["version"] = version  # from the file's first bytes
    except (OSError, ValueError) as e:
        raise DamagedEntry(f"unreadable ({e})") from None
    return header, HEADER_ROOM


def _layout(h: dict[str, Any]) -> dict[str, int]:
    """Byte sizes of one layer's sections: full-block K (= V), anchors, remainder K (= V)."""
    L, H, d = h["content"]["shape"]
    kv_type = h["content"]["kv_type"]
    row = row_elems(kv_type, d) * np.dtype(KV_TYPES[kv_type][0]).itemsize  # one KV row's bytes
    nb, bs, A, rem = h["n_blocks"], h["content"]["block_size"], h["anchor_num"], h["remainder"]
    arow = 2 * d if h.get("version", VERSION) == 1 else d + Q8_EXTRA  # one anchor's bytes
    kv, an, rm = H * nb * bs * row, H * nb * A * arow, H * rem * row
    return {
        "kv": kv,
        "anchors": an,
        "rem": rm,
        "layer": 2 * _align(kv) + _align(an) + 2 * _align(rm),
    }


def _window_bytes(h: dict[str, Any]) -> int:
    """Bytes of the sliding-window rows' section (0 for a model without such layers)."""
    w = h.get("window")
    if not w:
        return 0
    _, H, d = h["content"]["shape"]
    return w["layers"] * 2 * H * w["rows"] * d * 4


def verify(path: Path, header: dict[str, Any], offset: int, keep_cached: bool = False) -> float:
    """Check size and every layer's CRC by plain reads (not through the map: RSS stays flat).
    With keep_cached the pages read stay in the page cache for the map to use."""
    t0 = time.perf_counter()
    per_layer = _layout(header)["layer"]
    ids_bytes = _align(header["n_tokens"] * 4)
    win = _align(_window_bytes(header))
    size = offset + ids_bytes + per_layer * header["content"]["shape"][0] + win
    if path.stat().st_size != size:
        raise DamagedEntry(f"truncated ({path.stat().st_size} of {size} bytes)")
    buf = bytearray(1 << 22)
    crcs = []
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        for want in [ids_bytes] + [per_layer] * len(header["layer_crc"]) + ([win] if win else []):
            crc, left = 0, want
            while left:
                n = f.readinto(memoryview(buf)[: min(left, len(buf))])
                if not n:
                    raise DamagedEntry("truncated")
                crc, left = zlib.crc32(memoryview(buf)[:n], crc), left - n
            crcs.append(crc)
        if not keep_cached:  # an entry read a step's blocks at a time: leave the page cache as
            # it was, or every fault maps the cached neighbours of its block (fault-around) and
            # RSS tracks the file size
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    want = [header["ids_crc"], *header["layer_crc"]] + ([header["window"]["crc"]] if win else [])
    if crcs != want:
        raise DamagedEntry("checksum mismatch (the file was modified or damaged)")
    return time.perf_counter() - t0


def anchor_label(settings: Settings) -> str:
    """What an entry's anchors are: the anchor type, with ":NEAR" when the keys were turned back
    to position 0 first (score_positions NEAR)."""
    return settings.anchor_type + (":NEAR" if settings.score_positions == "NEAR" else "")


MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14


def _advise_map(m: mmap.mmap, resident: bool) -> None:
    """A resident entry's pages (in the page cache since the checksum pass) mapped now, so no
    decode step faults them in one by one (SmolLM2 at 32K: 23 tok/s faulting, 32 mapped); an
    entry read block by block gets no readahead around the scattered blocks a step reads."""
    if not resident:
        m.madvise(mmap.MADV_RANDOM)
        return
    try:
        m.madvise(MADV_POPULATE_READ)
    except OSError:  # an older kernel: at least fault neighbours in together
        m.madvise(mmap.MADV_WILLNEED)


def map_entry(
    path: Path,
    header: dict[str, Any],
    offset: int,
    capacity: int,
    anchor_type: str,
    anchor_num: int,
    resident: bool = False,
) -> tuple[KVStore, list[int]]:
    """A KVStore whose base segment is the entry's full blocks, memory-mapped read-only; the
    entry's anchors come with it when they are of `anchor_type` (an `anchor_label`) and
    `anchor_num`, else they are taken afresh when needed. `resident`: the entry stays in
    memory, mapped at once (no page fault while decoding); else it is read block by block."""
    c = header["content"]
    L, H, d = c["shape"]
    dtype = np.dtype(KV_TYPES[c["kv_type"]][0])
    row = row_elems(c["kv_type"], d)
    nb, bs, rem = header["n_blocks"], c["block_size"], header["remainder"]
    n_ids = header["n_tokens"]
    n = header.get("rows", n_ids)  # KV rows
    sz = _layout(header)
    ids = np.memmap(path, np.int32, "r", offset, (n_ids,)).tolist() if n_ids else []
    o = offset + _align(n_ids * 4)
    n_base = (n - 1) // bs if n else 0  # mapped blocks; >= 1 token stays writable for re-feeding
    ks, vs, anchors, tails = [], [], [], []
    for _ in range(L):
        k = (np.memmap(path, dtype, "r", o, (H, nb, bs, row)) if nb
             else np.zeros((H, 0, bs, row), dtype))
        v = np.memmap(path, dtype, "r", o + _align(sz["kv"]), (H, nb, bs, row)) if nb else k
        ks.append(k)  # whole arrays (C-contiguous); the store uses blocks [0, n_base)
        vs.append(v)
        o += 2 * _align(sz["kv"])
        if (header["anchor_type"], header["anchor_num"]) == (anchor_type, anchor_num) and nb:
            if header["version"] == 1:  # BF16 anchors: to Q8
                a = kv_to_f64(np.memmap(path, np.uint16, "r", o, (H, nb, anchor_num, d)), 1)
                anchors.append(q8_encode(a.astype(np.float32), anchor_type.startswith("QUEST")))
            else:
                anchors.append(
                    np.array(np.memmap(path, np.uint8, "r", o, (H, nb, anchor_num, d + Q8_EXTRA)))
                )
        o += _align(sz["anchors"])
        tk = [k[:, b].reshape(H, bs, row) for b in range(n_base, nb)]  # [H, bs, row] each
        tv = [v[:, b].reshape(H, bs, row) for b in range(n_base, nb)]
        if rem:
            tk.append(np.memmap(path, dtype, "r", o, (H, rem, row)))
            tv.append(np.memmap(path, dtype, "r", o + _align(sz["rem"]), (H, rem, row)))
        o += 2 * _align(sz["rem"])
        tails.append((np.concatenate(tk, 1), np.concatenate(tv, 1)))  # [H, n - n_base*bs, row]
    for arr in ks + vs:
        if isinstance(arr, np.memmap) and hasattr(arr._mmap, "madvise"):
            _advise_map(arr._mmap, resident)
    shape = StoreShape(L, H, d, bs, c["kv_type"], anchor_num)
    store = KVStore(shape, capacity, base=(ks, vs), base_anchors=anchors or None, nb_base=n_base)
    for layer, (tk_, tv_) in enumerate(tails):  # the last block(s) go to the writable tail
        store.write_rows(layer, tk_, tv_)
    w = header.get("window")
    if w:  # the sliding-window layers' last rows
        store.window_rows = np.array(np.memmap(path, np.float32, "r", o,
                                               (w["layers"], 2, H, w["rows"], d)))
    cos = header.get("layer_cos")  # absent in entries older than layer_budget: UNIFORM then
    if isinstance(cos, dict) and len(cos.get("sum", ())) == L and cos.get("tokens", 0) > 0:
        store.add_layer_cos(np.asarray(cos["sum"], np.float64), int(cos["tokens"]))
    return store, ids


# --- writing -------------------------------------------------------------------------------------
def _raw(a: np.ndarray) -> np.ndarray:
    """The bytes of `a` as a flat uint8 array (a buffer f.write and zlib take, even when empty)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _head_blocks(store: KVStore, layer: int, which: str, n_full: int) -> Iterator[np.ndarray]:
    """Full blocks [0, n_full) of one layer's K or V, head by head, without a layer-sized copy."""
    base = getattr(store, f"{which}_base")[layer]
    tail = getattr(store, f"{which}_tail")[layer]
    nb_base = store.nb_base
    for h in range(store.shape.n_kv_heads):
        yield _raw(np.ascontiguousarray(base[h, : min(n_full, nb_base)]))
        if n_full > nb_base:
            yield _raw(np.ascontiguousarray(tail[h, : n_full - nb_base]))


def write_entry(
    path: Path, session: Session, content: dict[str, Any], extra: dict[str, Any]
) -> Path:
    """Write the session's store to `path` atomically (temp name, fsync, rename)."""
    store, n = session.store, session.store.length
    bs = store.shape.block_size
    n_full, rem = n // bs, n % bs
    header = {
        "content": content,
        "n_tokens": len(session.tokens),
        "rows": n,  # KV rows: fewer than the tokens where a LOCRET prefill dropped some
        "n_blocks": n_full,
        "remainder": rem,
        "anchor_num": store.shape.anchor_num,
        "anchor_type": anchor_label(session.settings),
        # each layer's input/output cosine summed over the prefilled tokens (layer_budget SQUEEZE)
        "layer_cos": {"sum": store.layer_cos_sum.tolist(), "tokens": store.layer_cos_tokens},
        "created": time.time(),
        **extra,
    }
    sz = _layout(header)
    session.policy.complete_anchors()
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    crcs: list[int] = []
    ids = np.asarray(session.tokens, np.int32)

    def section(f: Any, parts: Any, size: int, crc: int) -> int:
        for p in parts:
            f.write(p)
            crc = zlib.crc32(p, crc)
        pad = bytes(_align(size) - size)
        f.write(pad)
        return zlib.crc32(pad, crc)

    try:
        with open(tmp, "wb") as f:
            # the header is written last, once the CRCs are known: reserve its room first
            f.write(bytes(HEADER_ROOM))
            ids_crc = section(f, [_raw(ids)], ids.nbytes, 0)
            for layer in range(store.shape.n_layers):
                crc = section(f, _head_blocks(store, layer, "k", n_full), sz["kv"], 0)
                crc = section(f, _head_blocks(store, layer, "v", n_full), sz["kv"], crc)
                a = np.ascontiguousarray(store.anchors[layer][:, :n_full])
                crc = section(f, [_raw(a)], sz["anchors"], crc)
                rems = [np.zeros(0, np.uint8)] * 2
                if rem:  # the partial last block: [H, rem, row] each
                    rems = list(store.row_range(layer, n_full * bs, n))
                for r in rems:
                    crc = section(f, [_raw(np.ascontiguousarray(r))], sz["rem"], crc)
                crcs.append(crc)
            header.update(ids_crc=ids_crc, layer_crc=crcs)
            if session.window is not None:
                rows = session.window.state(n)  # [layers, 2, Hkv, window, d]
                crc = section(f, [_raw(rows)], rows.nbytes, 0)
                header["window"] = {"layers": rows.shape[0], "rows": rows.shape[3], "crc": crc}
            raw = json.dumps(header).encode()
            if 20 + len(raw) > HEADER_ROOM:
                raise KtlongError("cache header too large")
            f.seek(0)
            f.write(MAGIC + struct.pack("<IQ", VERSION, len(raw)) + raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise KtlongError(
                f"could not write the prompt cache to {path.parent}: {e.strerror}",
                hint="free disk space, move it with --cache-dir, or use --no-cache",
            ) from None
        raise
    return path


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- the cache: lookup, open, save, list, evict --------------------------------------------------
@contextmanager
def _lock(root: Path, key: str) -> Iterator[None]:
    """One prefill per document at a time: a second process waits, then finds the entry."""
    (root / "locks").mkdir(parents=True, exist_ok=True)
    with open(root / "locks" / f"{key}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@dataclass
class Entry:
    path: Path
    header: dict[str, Any]
    size: int
    last_used: float

    @property
    def key(self) -> str:
        return self.path.stem


class PromptCache:
    """Entries in `root/entries` (documents, evicted LRU) and `root/saved` (named, kept)."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root, self.max_bytes = root, max_bytes

    def entries(self, folder: str = "entries") -> list[Entry]:
        out = []
        for p in sorted((self.root / folder).glob(f"*{SUFFIX}")):
            try:
                header, _ = read_header(p)
                st = p.stat()
            except (DamagedEntry, OSError):
                header, st = {}, p.stat()
            out.append(Entry(p, header, st.st_size, st.st_mtime))
        return out

    def _open(self, entry: Entry, settings: Settings) -> tuple[KVStore, list[int], float]:
        header, offset = read_header(entry.path)
        resident = stays_resident(entry.path.stat().st_size)
        spent = verify(entry.path, header, offset, keep_cached=resident)
        store, ids = map_entry(
            entry.path,
            header,
            offset,
            settings.max_seq_len,
            anchor_label(settings),
            settings.anchor_num,
            resident,
        )
        os.utime(entry.path)  # last used, for LRU eviction
        return store, ids, spent

    def find_prefix(self, ck: dict[str, Any], ids: list[int]) -> Entry | None:
        """The longest entry for this model/kv whose tokens are a prefix of `ids`."""
        best = None
        for e in self.entries():
            h = e.header
            if h.get("content") != ck or h.get("n_tokens", 0) > len(ids) or h["n_tokens"] == 0:
                continue
            if h.get("ids_sha") == _ids_hash(ids[: h["n_tokens"]]) and (
                best is None or h["n_tokens"] > best.header["n_tokens"]
            ):
                best = e
        return best

    def find_other_type(self, ck: dict[str, Any], ids: list[int]) -> Entry | None:
        """The longest entry that `find_prefix` would give but for another kv_type."""
        best = None
        for kv_type in KV_TYPES:
            if kv_type != ck["kv_type"]:
                e = self.find_prefix({**ck, "kv_type": kv_type}, ids)
                if e and (best is None or e.header["n_tokens"] > best.header["n_tokens"]):
                    best = e
        return best

    def store(
        self, session: Session, ck: dict[str, Any], folder: str = "entries", name: str | None = None
    ) -> Path:
        (self.root / folder).mkdir(parents=True, exist_ok=True)
        key = name or entry_key(ck, session.tokens)
        path = write_entry(
            self.root / folder / f"{key}{SUFFIX}",
            session,
            ck,
            {"ids_sha": _ids_hash(session.tokens), "model_path": session.lm.spec.path},
        )
        if folder == "entries":
            self.evict(keep=path)
        return path

    def evict(self, keep: Path | None = None) -> list[Path]:
        """Remove least-recently-used document entries until the total fits `max_bytes`."""
        entries = sorted(self.entries(), key=lambda e: e.last_used)
        total, gone = sum(e.size for e in entries), []
        for e in entries:
            if total <= self.max_bytes:
                break
            if e.path != keep:
                e.path.unlink(missing_ok=True)
                total -= e.size
                gone.append(e.path)
        for tmp in (self.root / "entries").glob(f"*{SUFFIX}.tmp-*"):  # left by a killed writer
            pid = tmp.name.rsplit("-", 1)[-1]
            if pid.isdigit() and not _alive(int(pid)):
                tmp.unlink(missing_ok=True)
        return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


CONVERT_TOKENS = 32768  # tokens per layer converted at a time (bounds the float32 copy)


def convert_store(src: KVStore, shape: StoreShape, capacity: int,
                  tier: Path | None) -> KVStore:
    """A new store in `shape.kv_type` (RAM, or the disk tier in `tier`) holding src's tokens:
    each layer decoded to float32 and encoded again, a slice at a time; anchors are copied (their
    format does not depend on the KV's)."""
    dst = KVStore(shape, capacity, tier_dir=tier)
    n = src.length
    for layer in range(shape.n_layers):
        for t0 in range(0, n, CONVERT_TOKENS):
            dst.write(layer, *src.token_range(layer, t0, min(n, t0 + CONVERT_TOKENS)))
        na = src.n_anchored[layer]
        dst.anchors[layer][:, :na] = src.anchors[layer][:, :na]
        dst.n_anchored[layer] = na
        src.check_resident()
    dst.copy_layer_cos(src)
    dst.window_rows = src.window_rows
    return dst


def open_cache(settings: Settings, cache_dir: Path | None = None) -> PromptCache:
    return PromptCache(cache_root(settings, cache_dir), int(settings.cache_max_gb * 1e9))


def open_document(
    lm: LoadedModel,
    settings: Settings,
    ids: list[int],
    progress: Progress | None = None,
    use_cache: bool = True,
    cache_dir: Path | None = None,
) -> Opened:
    """A Session whose store holds `ids` (the document's prompt tokens).

    Uses the longest cache entry whose tokens are a prefix of `ids` and prefills only the rest;
    with no entry, prefills and stores the result. An entry that holds all of `ids` is taken as
    it is: its session has no logits yet (the caller appends the question). Feeding its last
    token again would recompute that token's K,V one row at a time, reading the rows before it
    from the store where the document's own prefill read them in its chunk, and the same
    question would get another answer than it does without the cache. A damaged or stale entry
    is reported in `Opened.note`, removed and recomputed. A failed write (disk full) costs the
    cache, not the chat.
    """
    n = len(ids)
    if settings.attention == "LOCRET":  # read within its budget, a chunk at a time
        from ktlong.memory import locret_rows

        n = min(n, locret_rows(settings))
    check_fits(lm.spec, settings, n)
    if not use_cache:
        session = Session(lm, settings)
        session.prefill(ids, progress)
        session.settle()
        return Opened(session, "prefill")
    cache = open_cache(settings, cache_dir)
    ck = content_key(lm.spec, settings)
    note = ""
    try:
        (cache.root / "locks").mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only or full disk: the chat goes on without the cache
        session = Session(lm, settings)
        session.prefill(ids, progress)
        session.settle()
        return Opened(session, "prefill", None, f"the prompt cache folder {cache.root} cannot "
                      f"be written ({e.strerror or e}): this chat is not cached")
    with _lock(cache.root, entry_key(ck, ids)):
        entry = cache.find_prefix(ck, ids)
        if entry is not None:
            try:
                store, cached_ids, spent = cache._open(entry, settings)
                session = Session(lm, settings, store=store, tokens=cached_ids)
                if len(cached_ids) < len(ids):
                    session.prefill(ids[len(cached_ids) :], progress)
                session.settle()
                return Opened(session, "cache", entry.path, verify_s=spent)
            except DamagedEntry as e:
                note = f"prompt cache entry {entry.path.name} is damaged ({e}); recomputing"
                entry.path.unlink(missing_ok=True)
        other = None if entry else cache.find_other_type(ck, ids)
        session, source = None, "prefill"
        if other is not None:  # the document is cached in another kv_type: convert it
            try:
                t0 = time.perf_counter()
                src, cached_ids, spent = cache._open(other, settings)
                shape = dataclasses.replace(src.shape, kv_type=settings.kv_type)
                store = convert_store(src, shape, settings.max_seq_len,
                                      tier_dir(lm.spec, settings))
                del src
                session, source = Session(lm, settings, store=store, tokens=cached_ids), "cache"
                note = (f"converted the cached {other.header['content']['kv_type']} KV to "
                        f"{settings.kv_type} in {time.perf_counter() - t0:.1f} s; saved in that "
                        "type too")
                if len(cached_ids) < len(ids):
                    session.prefill(ids[len(cached_ids) :], progress)
            except DamagedEntry as e:
                note = f"prompt cache entry {other.path.name} is damaged ({e}); recomputing"
                other.path.unlink(missing_ok=True)
                session, source = None, "prefill"
        if session is None:
            session = Session(lm, settings)
            session.prefill(ids, progress)
        session.settle()
        try:
            path = cache.store(session, ck)
        except KtlongError as e:
            return Opened(session, source, None, f"{e.message} ({e.hint})")
        except OSError as e:  # its folder cannot be made
            return Opened(session, source, None, f"could not write the prompt cache to "
                          f"{cache.root}: {e.strerror or e}")
        if session.store.tier is not None:  # read the entry's copy, free the tier's
            header, offset = read_header(path)
            entry, _ = map_entry(path, header, offset, settings.max_seq_len,
                                 anchor_label(settings), settings.anchor_num)
            session.store.adopt_base(entry)
    return Opened(session, source, path, note)


def save_conversation(
    session: Session, name: str, cache_dir: Path | None = None, state: dict[str, Any] | None = None
) -> Path:
    """Keep the whole conversation's KV under `name`, and `state` (the chat's text) beside it."""
    if not name.replace("-", "").replace("_", "").isalnum():
        raise KtlongError(f"bad name '{name}': use letters, digits, '-' and '_'")
    cache = open_cache(session.settings, cache_dir)
    path = cache.store(session, content_key(session.lm.spec, session.settings), "saved", name)
    side = path.with_suffix(".json")
    tmp = side.with_name(f"{side.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(state or {}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, side)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        raise KtlongError(f"could not save '{name}': {e.strerror}") from None
    return path


def load_conversation(
    lm: LoadedModel, settings: Settings, name: str, cache_dir: Path | None = None
) -> tuple[Session, dict[str, Any]]:
    """A Session resumed from a /save (chat's /load), and the state saved with it."""
    cache = open_cache(settings, cache_dir)
    path = cache.root / "saved" / f"{name}{SUFFIX}"
    if not path.exists():
        names = ", ".join(e.key for e in cache.entries("saved")) or "none saved yet"
        raise KtlongError(f"no saved conversation '{name}'", hint=f"saved: {names}")
    header, _ = read_header(path)
    if header.get("content") != content_key(lm.spec, settings):
        raise KtlongError(
            f"'{name}' was saved with another model or kv_type/block_size",
            hint=f"it was made with {header.get('model_path')}",
        )
    try:
        store, ids, _ = cache._open(Entry(path, header, 0, 0), settings)
        state = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
    except (DamagedEntry, OSError, ValueError) as e:
        raise KtlongError(
            f"saved conversation '{name}' cannot be used: {e}",
            hint="save it again, or remove it with `ktlong inspect cache --remove`",
        ) from None
    session = Session(lm, settings, store=store, tokens=ids)
    session.extend_to(ids)
    return session, state


def list_entries(settings: Settings, cache_dir: Path | None = None) -> list[dict[str, Any]]:
    """One row per entry for `ktlong inspect cache`."""
    cache = open_cache(settings, cache_dir)
    rows = []
    for kind in ("entries", "saved"):
        for e in cache.entries(kind):
            h = e.header
            rows.append(
                {
                    "key": e.key,
                    "kind": "document" if kind == "entries" else "saved",
                    "model": h.get("model_path", "?"),
                    "tokens": h.get("n_tokens"),
                    "kv_type": h.get("content", {}).get("kv_type"),
                    "bytes": e.size,
                    "created": h.get("created"),
                    "last_used": e.last_used,
                    "path": str(e.path),
                    "ok": bool(h),
                }
            )
    return rows


def remove_entries(
    settings: Settings, which: list[str], cache_dir: Path | None = None
) -> list[str]:
    """Remove entries by key prefix or saved name ('all' removes every one); returns the keys."""
    cache = open_cache(settings, cache_dir)
    every = cache.entries() + cache.entries("saved")
    gone = []
    for w in which:
        hits = [e for e in every if w == "all" or e.key.startswith(w)]
        if not hits:
            raise KtlongError(
                f"no prompt-cache entry matches '{w}'", hint="`ktlong inspect cache` lists them"
            )
        for e in hits:
            e.path.unlink(missing_ok=True)
            e.path.with_suffix(".json").unlink(missing_ok=True)
            gone.append(e.key)
    return sorted(set(gone))
