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
    assert r["kv_bytes_per_token"] == 131072 and r["weights_on"] == "DRAM"
    assert [row["label"] for row in r["rows"]][:4] == ["4K", "32K", "64K", "128K (model max)"]
    assert r["recommended_max_seq_len"] == memory.recommend_max_seq_len(REFERENCE, "BF16",
                                                                       100 * 10**9)


def test_report_from_a_model_folder(shape_dir: Callable[..., Path]) -> None:
    from ktlong.model import read_spec

    spec = read_spec(shape_dir())
    r = memory.report(spec, "FP16", 100 * 10**9, None)
    assert r["reference"] is False and r["max_positions"] == 262144
    row = next(x for x in r["rows"] if x["tokens"] == 131072)
    assert memory.gb(row["kv_bytes"]) == "17.2 GB"


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

    from ktlong.model import load_model, read_spec
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
