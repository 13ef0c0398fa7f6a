"""The int8 prefill GEMM's speed per tile product (kernels/qmatmul.py), beside torch's float32:
`ktlong bench qgemm [--paths avx2,amx] [--cpu avx2|avx-vnni] [--threads 1,2]`.

- tile: one tile product alone, 16 tokens x 16 weight rows over 4,096 channels (in L1), one
  thread, a 4-bit type's codes;
- matrix: `qgemm` of a 14336 x 4096 Q4_K matrix (random blocks) and 1,024 token rows;
- torch (with `--torch`): `F.linear` in float32 on the same shapes, and `QuantLinear` under
  `prefill_matmul` FP32 (tiles dequantised for torch: what a CPU without an int8 GEMM runs)
  and INT8.
Best of 3 (tile: of 5) each, in GOP/s (2 x multiply-adds a second).

`--cpu avx2` (or `avx-vnni`) runs it all in a child process taken for a CPU without AVX-512
(and, for avx2, without AVX-VNNI): llvmlite reports the narrower features, so ktlong's kernels
see 8 float lanes and pick that product; Numba compiles for haswell (alderlake), so no AVX-512
instruction can be emitted; torch is held to AVX2 (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS,
ONEDNN_MAX_CPU_ISA). The code then runs on this machine's cores: the figures are AVX2 code on
this CPU, not an AVX2-only CPU's.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

# --cpu: (the CPU Numba compiles for, the feature prefixes turned off)
NARROW = {"avx2": ("haswell", ("avx512", "amx", "avx10", "evex512", "avxvnni")),
          "avx-vnni": ("alderlake", ("avx512", "amx", "avx10", "evex512"))}


def narrow_prelude(cpu: str) -> str:
    """Python source to run first in a child process (before numba or ktlong is imported):
    this CPU taken for `cpu` (a key of NARROW)."""
    name, off = NARROW[cpu]
    return (
        "import os\n"
        "import llvmlite.binding as _llb\n"
        "_host = _llb.get_host_cpu_features\n"
        "def _narrow():\n"
        "    fm = _host()\n"
        "    for f in list(fm):\n"
        f"        fm[f] = fm[f] and not f.startswith({off!r})\n"
        "    return fm\n"
        "_llb.get_host_cpu_features = _narrow\n"
        f"os.environ['NUMBA_CPU_NAME'] = {name!r}\n"
        "os.environ['NUMBA_CPU_FEATURES'] = _narrow().flatten()\n")


def _best(f, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


def random_q4k(n: int, k: int, seed: int = 1) -> np.ndarray:
    """[n, k / 256 * 144] bytes of Q4_K blocks: random codes and 6-bit scales, d and dmin
    0.01."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n * k // 256, 144), dtype=np.uint8)
    raw[:, 0:4] = np.array([0.01, 0.01], np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def tile_gops(path: str, k: int = 4096, n: int = 2000) -> float:
    """One thread's rate of the tile product `path` alone (kernels/_qtile.py)."""
    from numba import njit

    from ktlong.kernels import _qtile as qt

    tile = {"amx": qt.amx32, "avx512-vnni": qt.vnni32, "avx-vnni": qt.avxvnni32,
            "avx2": qt.avx2_4bit}[path]

    @njit
    def loop(n, codes, dxs, sv, wb, s, z, out):
        for _ in range(n):
            tile(codes.ctypes.data, codes.shape[1], dxs.ctypes.data, sv.ctypes.data,
                 wb.ctypes.data, s.ctypes.data, z.ctypes.data, dxs.shape[1], out.ctypes.data, 64)

    rng = np.random.default_rng(0)
    nsub = k // 32
    codes = rng.integers(-127, 128, (16, k + 64)).astype(np.int8)  # [tokens, k + PAD]
    dxs, sv = rng.random((16, nsub), np.float32), rng.random((16, nsub), np.float32)
    wb = rng.integers(0, 16, k * 16).astype(np.uint8).view(np.uint32)  # [nsub, 8, 16, 4] codes
    s, z = rng.random((nsub, 16), np.float32), rng.random((nsub, 16), np.float32)
    out = np.zeros((16, 16), np.float32)
    args = (codes, dxs, sv, wb, s, z, out)
    loop(1, *args)
    return 2 * 256 * k * n / _best(lambda: loop(n, *args), 5) / 1e9


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="ktlong bench qgemm", description=__doc__.split(
        "\n")[0])
    ap.add_argument("--paths", help="tile products, comma-separated (default: all this CPU has)")
    ap.add_argument("--cpu", choices=sorted(NARROW), help="run as on a CPU without AVX-512")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--torch", action="store_true", help="also torch float32 and QuantLinear")
    a = ap.parse_args(argv)
    if a.cpu:
        env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", MKL_ENABLE_INSTRUCTIONS="AVX2",
                   ONEDNN_MAX_CPU_ISA="AVX2")
        rest = [x for x in (argv if argv is not None else sys.argv[1:])
                if x not in ("--cpu", a.cpu) and not x.startswith("--cpu=")]
        code = narrow_prelude(a.cpu) + "from ktlong.bench.qgemm import main\nmain()\n"
        sys.exit(subprocess.run([sys.executable, "-c", code, *rest], env=env).returncode)
    import torch
    import torch.nn.functional as F
    from torch import nn

    from ktlong import kernels
    from ktlong.kernels import _vec
    from ktlong.kernels import qmatmul as qm
    from ktlong.weights import QuantLinear, set_prefill_matmul

    have = [p for p in qm.GEMM_PATHS if qm.HAVE_PATH[p]]
    paths = a.paths.split(",") if a.paths else have
    for p in paths:
        if p not in have:
            sys.exit(f"no {p} int8 GEMM on this CPU (it has: {', '.join(have) or 'none'})")
    print(f"float lanes {_vec.W}; products {', '.join(have)}; torch "
          f"{torch.backends.cpu.get_cpu_capability()}", flush=True)
    for p in paths:
        print(f"tile {p}: 16 x 16 x 4096, 1 thread: {tile_gops(p):.0f} GOP/s", flush=True)
    n, k, m = 14336, 4096, 1024
    ops = 2 * n * k * m
    raw = random_q4k(n, k)
    x = np.random.default_rng(2).standard_normal((m, k)).astype(np.float32)
    ql = QuantLinear(raw, "Q4_K", k)
    holder = nn.Sequential(ql)
    xt, wf = torch.from_numpy(x), torch.randn(n, k)  # [m, k], [n, k] float32
    for t in (int(v) for v in a.threads.split(",")):
        kernels.configure_threads(t)
        torch.set_num_threads(t)
        for p in paths:
            qm.qgemm(raw[:64], 12, x[:32], path=p)
            dt = _best(lambda p=p: qm.qgemm(raw, 12, x, path=p), 3)
            print(f"matrix {p}: {n} x {k} Q4_K x {m} tokens, {t} threads: {dt:.2f} s, "
                  f"{ops / dt / 1e9:.0f} GOP/s", flush=True)
        if not a.torch:
            continue
        with torch.inference_mode():
            F.linear(xt[:64], wf)
            dt = _best(lambda: F.linear(xt, wf), 3)
            print(f"torch F.linear float32, {t} threads: {dt:.2f} s, {ops / dt / 1e9:.0f} GOP/s",
                  flush=True)
            for mode in ("FP32", "INT8"):
                ran = set_prefill_matmul(holder, mode)
                ql(xt[None, :32])
                dt = _best(lambda: ql(xt[None]), 3)
                print(f"QuantLinear, prefill_matmul {mode} ({ran}), {t} threads: {dt:.2f} s, "
                      f"{ops / dt / 1e9:.0f} GOP/s", flush=True)


if __name__ == "__main__":
    main()
