"""KV sizing, free memory (psutil + cgroup v1/v2), the memcheck table and max_seq_len choice."""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from ktlong import memory
from ktlong.memory import GIB, REFERENCE, ReferenceShape

# InternLM2.5-7B: 32 layers, 8 KV heads, head_dim 128
INTERNLM = ReferenceShape(path="internlm2.5-7b", n_layers=32, n_kv_heads=8, head_dim=128,
                          weights_bytes=15_500_000_000, max_positions=262144)


def test_kv_bytes_internlm_128k_is_17_2_gb() -> None:
    assert memory.kv_bytes_per_token(INTERNLM, "FP16") == 2 * 32 * 8 * 128 * 2 == 131072
    assert memory.kv_bytes_per_token(INTERNLM, "fp32") == 262144
    assert memory.gb(memory.kv_bytes_per_token(INTERNLM, "FP16") * 131072) == "17.2 GB"
    # the seed article's other columns (its 4K/32K/64K/512K agree to 3 digits)
    sizes = [memory.gb(memory.kv_bytes_per_token(INTERNLM, "FP16") * n)
             for n in (32768, 65536, 524288)]
    assert sizes == ["4.29 GB", "8.59 GB", "68.7 GB"]


def test_recommend_leaves_weights_and_os_headroom() -> None:
    free = 40 * 10**9
    n = memory.recommend_max_seq_len(INTERNLM, "FP16", free)
    assert n % 1024 == 0 and n > 0
    assert memory.dram_need(INTERNLM, "FP16", n) <= free < memory.dram_need(INTERNLM, "FP16",
                                                                             n + 1024)
    per_token = memory.kv_bytes_per_token(INTERNLM, "FP16")
    assert n * per_token * 1.1 <= free - INTERNLM.weights_bytes - 2 * GIB
    # with a GPU holding the weights, more tokens fit in DRAM
    assert memory.recommend_max_seq_len(INTERNLM, "FP16", free, weights_in_dram=False) > n
    # capped at the model's own positions, and 0 when nothing fits
    assert memory.recommend_max_seq_len(INTERNLM, "FP16", 10**15) == 262144
    assert memory.recommend_max_seq_len(INTERNLM, "FP16", 16 * 10**9) == 0


def test_length_rows_include_model_max_and_flags() -> None:
    free = 40 * 10**9
    rows = memory.length_rows(replace(INTERNLM, max_positions=200_000), "FP16", free, None)
    tokens = [r.tokens for r in rows]
    assert tokens == sorted(tokens) and 200_000 in tokens
    assert [r.label for r in rows if r.tokens == 200_000] == ["model max"]
    for r in rows:
        assert r.kv_bytes == 131072 * r.tokens
        assert r.fits_dram == (r.dram_need <= free)
        assert r.gpu_need is None and r.fits_gpu is None
    rows = memory.length_rows(INTERNLM, "FP16", free, 18 * 10**9)
    assert [r.label for r in rows if r.tokens == 262144] == ["256K (model max)"]
    r4k = rows[0]
    # with a GPU: DRAM holds no weights; the GPU holds weights + one layer's KV + activations
    assert r4k.dram_need == int(131072 * 4096 * 1.1) + 2 * GIB
    assert r4k.gpu_need == INTERNLM.weights_bytes + 131072 * 4096 // 32 + GIB
    assert r4k.fits_gpu is True and rows[-1].fits_gpu is False


def test_report_is_plain_data() -> None:
    r = memory.report(REFERENCE, "bf16", 100 * 10**9, None)
    assert r["reference"] is True and r["kv_type"] == "BF16"
    assert r["kv_bytes_per_token"] == {"BF16": 131072} and r["weights_on"] == "DRAM"
    assert [row["label"] for row in r["rows"]][:4] == ["4K", "32K", "64K", "128K (model max)"]
    # sparse attention reads past the model's 128K: what fits, up to 1M
    assert r["recommended_max_seq_len"] == memory.recommend_max_seq_len(
        REFERENCE, "BF16", 100 * 10**9, cap=1 << 20) > 131072
    assert r["longest"]["BF16"]["RAM"] == r["recommended_max_seq_len"]
    assert r["recommended"]["kv_type"] == "BF16" and r["recommended"]["kv_tier"] == "RAM"
    assert r["free_disk_bytes"] is None and r["longest"]["BF16"]["DISK"] is None


def test_report_from_a_model_folder(shape_dir: Callable[..., Path]) -> None:
    from ktlong.spec import read_spec

    spec = read_spec(shape_dir())
    r = memory.report(spec, "FP16", 100 * 10**9, None)
    assert r["reference"] is False and r["max_positions"] == 262144
    row = next(x for x in r["rows"] if x["tokens"] == 131072)
    assert memory.gb(row["kv_bytes"]) == "17.2 GB"


# --- kv_type x tier: the table, the longest contexts, the recommendation ------------------------

# an 8B GQA model (32 layers, 8 KV heads, head_dim 128) as a Q4_K_M GGUF, with a 1M context
GGUF_8B = ReferenceShape(path="8b-q4_k_m.gguf", weights_bytes=4_920_000_000, max_positions=1 << 20)
FREE_24GIB = 22 * 10**9  # free DRAM on a 24 GiB machine, with the OS and a desktop running


def test_quantised_rows_against_hand_computed_sizes() -> None:
    r = memory.report(GGUF_8B, None, FREE_24GIB, None, free_disk=100 * 10**9)
    assert r["kv_types"] == ["BF16", "Q8_0", "Q4_0"] and r["kv_type"] is None
    # a Q8_0 row: 128 values = 4 blocks of (32 codes + a float16 scale) = 136 bytes; Q4_0: 72
    assert r["kv_bytes_per_token"] == {"BF16": 2 * 32 * 8 * 256, "Q8_0": 2 * 32 * 8 * 136,
                                       "Q4_0": 2 * 32 * 8 * 72}
    rows = {(x["label"], x["kv_type"]): x for x in r["rows"]}
    assert len(rows) == len(r["rows"]) == 7 * 3
    q8 = rows["128K", "Q8_0"]
    assert q8["kv_bytes"] == q8["disk_need"] == 131072 * 69632 == 9_126_805_504  # 9.13 GB
    assert q8["dram_need"] == int(9_126_805_504 * 1.1) + 4_920_000_000 + 2 * GIB
    # disk tier DRAM: weights + 2 GiB + anchors (1024 blocks x 8 heads x 32 layers x 132 bytes)
    # + one decode step: (1 init + 96 selected + 32 local + 1 partial) blocks of 128 tokens
    assert memory.step_tokens(memory.Settings()) == 16640
    assert q8["disk_tier_dram"] == (4_920_000_000 + 2 * GIB + 32 * 8 * 1024 * 132
                                    + 16640 * 69632)
    assert q8["fits_dram"] is True and q8["fits_disk_tier"] is True
    q4 = rows["1M (model max)", "Q4_0"]
    assert q4["kv_bytes"] == q4["disk_need"] == 1048576 * 36864 == 38_654_705_664  # 38.7 GB
    assert q4["dram_need"] == int(38_654_705_664 * 1.1) + 4_920_000_000 + 2 * GIB
    assert q4["disk_tier_dram"] == (4_920_000_000 + 2 * GIB + 32 * 8 * 8192 * 132
                                    + 16640 * 36864)
    assert q4["fits_dram"] is False and q4["fits_disk_tier"] is True
    assert rows["1M (model max)", "Q8_0"]["fits_disk_tier"] is True  # 73 GB file, 8.5 GB DRAM
    assert rows["1M (model max)", "BF16"]["fits_disk_tier"] is False  # a 137 GB file
    assert rows["4K", "Q4_0"]["disk_tier_dram"] == (4_920_000_000 + 2 * GIB + 32 * 8 * 32 * 132
                                                    + 4096 * 36864)  # the window is the context


def test_reference_8b_gguf_on_a_24_gib_machine() -> None:
    """128K fits in RAM with Q8_0 (not BF16), and more, read with blocks past it; 1M fits with
    the disk tier."""
    at_128k = replace(GGUF_8B, max_positions=131072)
    choice = memory.choose(at_128k, FREE_24GIB, 100 * 10**9)
    assert (choice.kv_tier, choice.kv_type) == ("RAM", "Q8_0")
    assert choice.max_seq_len == memory.recommend_max_seq_len(at_128k, "Q8_0", FREE_24GIB,
                                                              cap=1 << 20) > 131072
    assert "full context (128K)" in choice.why and "BF16" in choice.why
    assert "read with blocks" in choice.why
    dense = replace(memory._DEFAULTS, attention="DENSE")  # reads every token: its own 128K
    choice = memory.choose(at_128k, FREE_24GIB, 100 * 10**9, settings=dense)
    assert (choice.kv_tier, choice.kv_type, choice.max_seq_len) == ("RAM", "Q8_0", 131072)
    choice = memory.choose(GGUF_8B, FREE_24GIB, 50 * 10**9)  # Q8_0's 1M needs a 73 GB file
    assert (choice.kv_tier, choice.kv_type, choice.max_seq_len) == ("DISK", "Q4_0", 1 << 20)
    choice = memory.choose(GGUF_8B, FREE_24GIB, 80 * 10**9)  # room for it: the more precise
    assert (choice.kv_tier, choice.kv_type, choice.max_seq_len) == ("DISK", "Q8_0", 1 << 20)
    assert choice.why.startswith("in free RAM at most ") and "full context (1M)" in choice.why


def test_longest_contexts_are_the_edge_of_what_fits() -> None:
    free, disk = 12 * 10**9, 30 * 10**9
    r = memory.report(GGUF_8B, None, free, None, free_disk=disk)
    for t in ("BF16", "Q8_0", "Q4_0"):
        n = r["longest"][t]["RAM"]
        assert memory.dram_need(GGUF_8B, t, n) <= free < memory.dram_need(GGUF_8B, t, n + 1024)
        n = r["longest"][t]["DISK"]
        assert n % 1024 == 0 and 0 < n < 1 << 20
        assert memory.disk_need(GGUF_8B, t, n) + memory.DISK_RESERVE <= disk
        assert memory.disk_tier_dram(GGUF_8B, t, n) <= free
        assert (memory.disk_need(GGUF_8B, t, n + 1024) + memory.DISK_RESERVE > disk
                or memory.disk_tier_dram(GGUF_8B, t, n + 1024) > free)
    # Q4_0 on disk: (30 GB - 1 GiB) / 36,864 bytes a token = 784,640 -> 766K
    assert r["longest"]["Q4_0"]["DISK"] == (30 * 10**9 - GIB) // 36864 // 1024 * 1024
    assert r["longest_with_disk"] == r["longest"]["Q4_0"]["DISK"]
    assert r["longest_in_dram"] == r["longest"]["Q4_0"]["RAM"] < r["longest_with_disk"]
    assert memory.longest(lambda n: n <= 5000, 10**6) == 4096
    assert memory.longest(lambda n: True, 200_000) == 200_000
    assert memory.longest(lambda n: False, 200_000) == 0


def test_choice_when_ram_is_short_but_disk_is_not() -> None:
    ram_only = 12 * 10**9  # Q4_0 in RAM reaches about 120K
    c = memory.choose(GGUF_8B, ram_only, 50 * 10**9)  # Q8_0's 1M (73 GB) does not fit on disk
    assert (c.kv_tier, c.kv_type, c.max_seq_len) == ("DISK", "Q4_0", 1 << 20)
    ram = memory.recommend_max_seq_len(GGUF_8B, "Q4_0", ram_only)
    assert f"at most {ram // 1024}K tokens fit (Q4_0)" in c.why
    # disk for less than RAM holds: RAM
    c = memory.choose(GGUF_8B, ram_only, 4 * 10**9)
    assert (c.kv_tier, c.kv_type, c.max_seq_len) == ("RAM", "Q4_0", ram)
    assert "reaches no further" in c.why
    # a --kv-type is kept: only the tier and the length are chosen
    c = memory.choose(GGUF_8B, ram_only, 200 * 10**9, ["bf16"])  # a 137 GB file
    assert (c.kv_tier, c.kv_type, c.max_seq_len) == ("DISK", "BF16", 1 << 20)
    c = memory.choose(GGUF_8B, ram_only, 100 * 10**9, ["bf16"])
    assert (c.kv_tier, c.kv_type) == ("DISK", "BF16") and 512 << 10 < c.max_seq_len < 1 << 20
    assert "BF16 reaches the most" in c.why
    # both short: nothing
    c = memory.choose(GGUF_8B, 5 * 10**9, 10**9)
    assert c.max_seq_len == 0


def test_dense_attention_keeps_every_token_resident() -> None:
    dense = memory.Settings(attention="DENSE")
    n = 262144
    assert memory.resident_bytes(GGUF_8B, "Q4_0", n, dense) == 36864 * n
    two = memory.Settings(dense_layer_num=2)
    assert memory.resident_bytes(GGUF_8B, "Q4_0", n, two) == 1152 * (2 * n + 30 * 16640)


def test_free_disk_walks_up_to_an_existing_folder(tmp_path: Path) -> None:
    free = memory.free_disk_bytes(tmp_path / "no" / "such" / "folder")
    assert free == psutil.disk_usage(str(tmp_path)).free or abs(
        free - psutil.disk_usage(str(tmp_path)).free) < 64 << 20  # other writers meanwhile
    st = memory.Settings(cache_dir=str(tmp_path / "c"))
    assert memory.tier_folder(st) == tmp_path / "c" / "tier"


def test_room_problem_per_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    """The preflight: RAM tier checks DRAM for the KV, the disk tier checks the disk for its file
    (sized for max_seq_len) and DRAM for the rest; each refusal is one line with a hint."""
    ram = memory.Settings(kv_tier="RAM", kv_type="Q8_0", max_seq_len=1 << 20)
    e = memory.room_problem(GGUF_8B, ram, 500_000, FREE_24GIB, 100 * 10**9)
    assert e is not None and "\n" not in e.message
    assert e.message.startswith("500,000 tokens of Q8_0 KV cache (34.8 GB) need ")
    assert "kv_tier=DISK" in e.hint and "memcheck" in e.hint
    e = memory.room_problem(GGUF_8B, ram, 500_000, FREE_24GIB, 10**9)  # no disk either
    assert "kv_tier" not in e.hint and "--kv-type Q4_0" in e.hint
    assert memory.room_problem(GGUF_8B, ram, 100_000, FREE_24GIB, 0) is None
    disk = memory.Settings(kv_tier="DISK", kv_type="Q4_0", max_seq_len=1 << 20)
    assert memory.room_problem(GGUF_8B, disk, 500_000, FREE_24GIB, 40 * 10**9) is None
    e = memory.room_problem(GGUF_8B, disk, 500_000, FREE_24GIB, 30 * 10**9)
    assert e.message.startswith("the KV disk tier needs 38.7 GB in ") and "30 GB is free" in \
        e.message
    assert e.hint.startswith("lower max_seq_len to 766K or less")
    e = memory.room_problem(GGUF_8B, disk, 500_000, 5 * 10**9, 40 * 10**9)
    assert "of RAM even with the KV on disk" in e.message
    # AUTO resolves like the Session does: RAM when max_seq_len fits in free DRAM
    auto = memory.Settings(kv_type="Q4_0", max_seq_len=65536)
    assert memory.room_problem(GGUF_8B, auto, 65536, FREE_24GIB, 0) is None
    auto = memory.Settings(kv_type="Q4_0", max_seq_len=1 << 20)
    assert "disk tier" in memory.room_problem(GGUF_8B, auto, 1000, FREE_24GIB, 0).message


def test_check_fits_refuses_what_fits_neither_in_ram_nor_on_disk(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from ktlong.engine import check_fits
    from ktlong.errors import KtlongError

    monkeypatch.setattr(memory, "free_dram_bytes", lambda: 6 * 10**9)
    monkeypatch.setattr(memory, "free_disk_bytes", lambda folder: 20 * 10**9)
    st = memory.Settings(kv_type="Q4_0", max_seq_len=1 << 20, cache_dir=str(tmp_path))
    with pytest.raises(KtlongError) as e:  # AUTO: DISK; the 38.7 GB file does not fit
        check_fits(GGUF_8B, st, 200_000)
    assert "the KV disk tier needs 38.7 GB in " + str(tmp_path / "tier") in e.value.message
    assert "lower max_seq_len to" in e.value.hint
    check_fits(GGUF_8B, replace(st, max_seq_len=262144), 200_000)  # 9.7 GB on disk: fits
    # a store exists (capacity given): only max_seq_len is checked, nothing is re-read
    monkeypatch.setattr(memory, "free_disk_bytes", lambda folder: 0)
    check_fits(GGUF_8B, st, 200_000, capacity=1 << 20)


# --- free memory --------------------------------------------------------------------------------

def _files(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_cgroup_v2(tmp_path: Path) -> None:
    proc = tmp_path / "proc-cgroup"
    proc.write_text("0::/\n")
    _files(tmp_path, {"memory.max": "8589934592\n", "memory.current": "3000000000\n",
                      "memory.stat": "anon 2000000000\ninactive_file 1000000000\n"})
    assert memory.cgroup_free_bytes(tmp_path, proc) == 8589934592 - 2000000000
    (tmp_path / "memory.max").write_text("max\n")
    assert memory.cgroup_free_bytes(tmp_path, proc) is None
    # our own cgroup below the mount point wins
    proc.write_text("0::/app.slice/job\n")
    _files(tmp_path, {"app.slice/job/memory.max": "4000000000\n",
                      "app.slice/job/memory.current": "1000000000\n"})
    assert memory.cgroup_free_bytes(tmp_path, proc) == 3000000000


def test_cgroup_v1(tmp_path: Path) -> None:
    proc = tmp_path / "proc-cgroup"
    proc.write_text("4:memory:/docker/abc\n")
    _files(tmp_path, {"memory/memory.limit_in_bytes": "4294967296\n",
                      "memory/memory.usage_in_bytes": "1294967296\n",
                      "memory/memory.stat": "cache 5\ntotal_inactive_file 294967296\n"})
    assert memory.cgroup_free_bytes(tmp_path, proc) == 4294967296 - 1000000000
    (tmp_path / "memory/memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert memory.cgroup_free_bytes(tmp_path, proc) is None
    assert memory.cgroup_free_bytes(tmp_path / "nothing", proc) is None


def test_free_dram_is_capped_by_psutil_and_cgroup(monkeypatch: pytest.MonkeyPatch) -> None:
    free = memory.free_dram_bytes()
    assert 0 < free <= psutil.virtual_memory().total
    monkeypatch.setattr(memory, "cgroup_free_bytes", lambda: 12345)
    assert memory.free_dram_bytes() == 12345


@pytest.mark.skipif(any(Path(p).exists() for p in ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")),
                    reason="a GPU device is present")
def test_no_gpu_means_none_without_importing_torch() -> None:
    code = ("import sys; from ktlong import memory; print(memory.free_gpu_bytes(), "
            "'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["None", "False"]


HEAP_SCRIPT = """
import sys
if sys.argv[1] == "limit":
    from ktlong.memory import limit_heap_retention
    assert limit_heap_retention()
import torch
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 >> 20
a = torch.ones(8 << 20); del a  # a big free raises glibc's dynamic mmap threshold
r0, keep = rss(), []
for _ in range(40):  # 3 MB activations freed between small live blocks, as in a prefill
    x = torch.ones(3 << 18)
    keep.append(torch.ones(1000))
    del x
big = [torch.ones(3 << 18) for _ in range(40)]
del big
print(rss() - r0)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_activations_leave_rss_once_heap_retention_is_limited():
    def growth(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", HEAP_SCRIPT, mode], capture_output=True,
                             text=True, check=True)
        return int(out.stdout.split()[-1])

    assert growth("default") > 100  # glibc keeps the freed 3 MB blocks in its heap
    assert growth("limit") < 20


def test_quantised_gguf_is_budgeted_as_the_file_it_is_read_from():
    """memcheck counts what the loader holds: on the CPU a quantised GGUF's tensors stay in the
    mapped file (norms are copied to float32, a few KB)."""
    import gguf

    from ktlong.model import load_model
    from ktlong.spec import read_spec
    from ktlong.weights import QuantLinear
    from tests.models import gguf_model

    path = gguf_model("llama", "Q8_0")
    spec = read_spec(path)
    lm = load_model(path, "CPU")
    mapped = {m.raw.ctypes.data: m.raw.nbytes for m in lm.model.modules()
              if isinstance(m, QuantLinear)}
    copied = sum(t.numel() * t.element_size()
                 for name, t in [*lm.model.named_parameters(), *lm.model.named_buffers()]
                 if "rotary" not in name)  # RoPE frequencies are not weights
    assert spec.weights_bytes == sum(mapped.values()) + copied
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)
    assert spec.weights_bytes == file_bytes
