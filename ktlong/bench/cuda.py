"""`ktlong bench cuda`: the GPU paths against the CPU, on tiny random models (no downloads) or
on a real model (`--model`).

For each architecture and each way of reading (dense; block-sparse with its defaults; NEAR
scoring with COMPACT reads and question blocks; WINDOW and MINFERENCE prefills; LOCRET), the same
prompt is prefilled and answered greedily on the CPU and on CUDA, with the local window on the
GPU and without: the answers must be the same tokens, and the report gives the largest
difference of the last logits and of the stored K, V. Then prefill tok/s and peak GPU memory at
two lengths on a wider model (4 layers, hidden 1024), and decode tok/s with and without the GPU
local window, against the CPU.

With `--model`, the same on that model and real prose (ktlong.bench.prose): the dense and
default profiles answer a 4K-token prompt on the CPU, with the weights widened to float32 as
CUDA holds them, and on CUDA; then prefill and decode speed at `--lengths` on CUDA, and on the
CPU (the weights as the file keeps them) at the first.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ktlong.config import Settings
from ktlong.errors import KtlongError

# tiny models read everything at these sizes: blocks of 16, a 64-token window, 256-token chunks
TINY = dict(kv_type="FP32", block_size=16, init_len=16, local_windows_len=64,
            second_select_num=8, chunk_size=256, max_seq_len=8192, preselect_block_count=16,
            question_blocks=0, block_positions="AS_IS", score_positions="AS_IS")
CASES: dict[str, dict[str, Any]] = {
    "dense": dict(attention="DENSE", prefill="DENSE"),
    "sparse": {},
    "near-compact": dict(score_positions="NEAR", block_positions="COMPACT", question_blocks=2),
    "prefill-window": dict(prefill="WINDOW", prefill_window=512),
    "prefill-minference": dict(prefill="MINFERENCE"),
    "locret": dict(attention="LOCRET", prefill="DENSE", locret_scores="ATTENTION",
                   locret_budget=512, locret_stabilisers=64),
}
ARCHS = ("llama", "qwen3", "gemma3_text")


def _model(root: Path, arch: str) -> Path:
    from ktlong.tinymodel import make_model

    kw: dict[str, Any] = {}
    if arch == "gemma3_text":  # a global layer every sixth: six layers, a 128-token window
        kw = dict(layers=6, hidden=64, heads=4, kv_heads=2, sliding_window=128)
    return make_model(root / arch, arch, seed=1, qk_scale=2.0, **kw)


def _run(path: Path, device: str, ids: list[int], st: Settings, n_new: int) -> dict[str, Any]:
    from ktlong.engine import Sampling, Session
    from ktlong.model import load_model

    lm = load_model(path, device=device, dtype="float32")
    s = Session(lm, st)
    logits = s.prefill(ids)[-1].float().cpu()
    toks = [x.token_id for x in s.generate(Sampling(max_new_tokens=n_new))]
    kv = [s.store.token_range(layer, 0, s.store.length) for layer in
          range(s.store.shape.n_layers)]
    return {"logits": logits, "tokens": toks, "kv": kv,
            "local": s.router.local is not None}


def agree(archs: tuple[str, ...] = ARCHS, cases: tuple[str, ...] = tuple(CASES),
          n_tokens: int = 3000, n_new: int = 24, gpu: str = "CUDA",
          threads: int = 8) -> list[dict[str, Any]]:
    """Per (arch, case): the CPU's answer, and per GPU run (local window on the GPU or not)
    whether its answer is the same, and the largest logit and K/V differences. One thread count
    for every run: the CPU's sums split by threads, so a count that moved would move the bits."""
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 products, as on the CPU
    ids = torch.randint(2, 500, (n_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = []
    with tempfile.TemporaryDirectory(prefix="ktlong-bench-cuda-") as tmp:
        for arch in archs:
            path = _model(Path(tmp), arch)
            for case in cases:
                if arch == "gemma3_text" and case == "locret":
                    continue  # LOCRET reads no sliding-window model
                st = dataclasses.replace(Settings(), **{**TINY, **CASES[case]},
                                         threads_num=threads)
                ref = _run(path, "CPU", ids, st, n_new)
                row: dict[str, Any] = {"arch": arch, "case": case, "tokens": ref["tokens"]}
                for local in (True, False):
                    got = _run(path, gpu, ids, dataclasses.replace(st, gpu_local_window=local),
                               n_new)
                    kv_err = max(float((a - b).abs().max())
                                 for pa, pb in zip(ref["kv"], got["kv"], strict=True)
                                 for a, b in zip(pa, pb, strict=True))
                    row["gpu_local" if local else "cpu_local"] = {
                        "same": got["tokens"] == ref["tokens"],
                        "logit_err": float((got["logits"] - ref["logits"]).abs().max()),
                        "kv_err": kv_err, "local_on_gpu": got["local"]}
                rows.append(row)
    return rows


def speed(lengths: tuple[int, ...] = (16384, 65536), threads: int = 8) -> list[dict[str, Any]]:
    """Prefill tok/s, peak GPU memory and decode tok/s: CUDA (local window on the GPU and not)
    at each length, the CPU at the first."""
    from ktlong.model import load_model
    from ktlong.tinymodel import make_model

    rows = []
    with tempfile.TemporaryDirectory(prefix="ktlong-bench-cuda-") as tmp:
        path = make_model(Path(tmp) / "wide", "llama", seed=1, layers=4, hidden=1024, heads=16,
                          kv_heads=4)
        base = dataclasses.replace(Settings(), max_seq_len=max(lengths) + 4096,
                                   threads_num=threads, kv_type="FP32")
        runs = [("CUDA", n, local) for n in lengths for local in (True, False)]
        for device, n, local in runs + [("CPU", lengths[0], False)]:
            lm = load_model(path, device=device, dtype="float32")
            ids = torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(0)).tolist()
            rows.append(_timed(lm, dataclasses.replace(base, gpu_local_window=local), ids))
    return rows


def _timed(lm: Any, st: Settings, ids: list[int]) -> dict[str, Any]:
    """One prefill of `ids` and 48 decode steps (after 8 to warm): tok/s and peak GPU memory."""
    from ktlong.engine import Sampling, Session

    cuda = lm.device.type == "cuda"
    s = Session(lm, st)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    s.prefill(ids)
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if cuda else None
    list(s.generate(Sampling(max_new_tokens=8)))  # warm
    last = list(s.generate(Sampling(max_new_tokens=48)))[-1].stats
    return {"device": "CUDA" if cuda else "CPU", "tokens": len(ids),
            "gpu_local": st.gpu_local_window, "prefill_tok_s": len(ids) / dt,
            "peak_gpu_bytes": peak, "decode_tok_s": last.decode_tok_s,
            "attended": last.attended_share}


def _fitted(lm: Any, profile: str, overrides: dict[str, Any]) -> Settings:
    from ktlong.config import resolve_settings
    from ktlong.fit import fit_to_model

    return fit_to_model(resolve_settings(profile, overrides, config_file=False), lm.spec).settings


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def model_agree(path: Path, n_tokens: int = 4096, n_new: int = 32, threads: int = 8,
                profiles: tuple[str, ...] = ("dense", "default"),
                gpu: str = "CUDA") -> list[dict[str, Any]]:
    """Per profile: the CPU's greedy answer (float32 weights, as CUDA holds them) and per GPU run
    (local window on the GPU or not) the tokens in common with it and the largest last-logit
    difference."""
    from ktlong.bench import prose
    from ktlong.engine import Sampling, Session
    from ktlong.model import load_model

    torch.backends.cuda.matmul.allow_tf32 = False
    cpu = load_model(path, device="CPU", dtype="float32", weight_type="FP32")
    on_gpu = load_model(path, device=gpu, dtype="float32", weight_type="FP32")
    ids = prose.ids(cpu.tokenizer, n_tokens, seed=0)
    rows = []
    for profile in profiles:
        st = _fitted(cpu, profile, {"threads_num": threads, "max_seq_len": n_tokens + 2 * n_new,
                                    "kv_tier": "RAM"})
        answers = {}
        for name, lm, local in (("cpu", cpu, False), ("gpu_local", on_gpu, True),
                                ("cpu_local", on_gpu, False)):
            s = Session(lm, dataclasses.replace(st, gpu_local_window=local))
            logits = s.prefill(ids)[-1].float().cpu()
            toks = [x.token_id for x in s.generate(Sampling(max_new_tokens=n_new))]
            answers[name] = (toks, logits)
        ref, ref_logits = answers.pop("cpu")
        row: dict[str, Any] = {"case": profile, "tokens": ref,
                               "text": cpu.tokenizer.decode(ref)}
        for name, (toks, logits) in answers.items():
            row[name] = {"same": toks == ref, "common": _common(toks, ref),
                         "logit_err": float((logits - ref_logits).abs().max())}
        rows.append(row)
    return rows


def model_speed(path: Path, lengths: tuple[int, ...], threads: int = 8) -> list[dict[str, Any]]:
    """The default profile fitted to the model: prefill tok/s, peak GPU memory, decode tok/s on
    CUDA (local window on the GPU and not) at each length, and on the CPU at the first."""
    from ktlong.bench import prose
    from ktlong.model import load_model

    rows = []
    for device in ("CUDA", "CPU"):
        lm = load_model(path, device=device)
        for n in lengths if device == "CUDA" else lengths[:1]:
            ids = prose.ids(lm.tokenizer, n, seed=0)
            st = _fitted(lm, "default", {"threads_num": threads, "max_seq_len": n + 4096})
            for local in (True, False) if device == "CUDA" else (False,):
                rows.append(_timed(lm, dataclasses.replace(st, gpu_local_window=local), ids))
    return rows


def main(as_json: bool, threads: int, model: Path | None = None,
         lengths: tuple[int, ...] = (4096, 32768)) -> dict[str, Any]:
    from ktlong import render

    if not torch.cuda.is_available():
        raise KtlongError("ktlong bench cuda needs a CUDA GPU, and torch sees none",
                          hint="run it on a machine with one (a CUDA build of torch)")
    result: dict[str, Any] = {
        "bench": "cuda", "device": torch.cuda.get_device_name(0), "threads": threads or 8,
        "command": "ktlong bench cuda" + (f" -m {model} --lengths {','.join(map(str, lengths))}"
                                          if model else "") + (f" -t {threads}" if threads else "")}
    if model is None:
        result.update(agree=agree(threads=threads or 8), speed=speed(threads=threads or 8))
    else:
        result.update(model=Path(model).name, agree=model_agree(model, threads=threads or 8),
                      speed=model_speed(model, lengths, threads=threads or 8))
    if as_json:
        render.print_json(result)
        return result
    c = render.console()
    c.print(f"[bold]{result['device']}[/] against the CPU, "
            f"{result.get('model', 'tiny random models')}, greedy")
    for r in result["agree"]:
        g, p = r["gpu_local"], r["cpu_local"]
        kv = f"  K,V {max(g['kv_err'], p['kv_err']):.1e}" if "kv_err" in g else ""
        c.print(f"{r.get('arch', ''):<12} {r['case']:<19} same tokens: {g['same']} / {p['same']}  "
                f"logits {max(g['logit_err'], p['logit_err']):.1e}{kv}")
    for r in result["speed"]:
        peak = ("" if r["peak_gpu_bytes"] is None
                else f", peak GPU {r['peak_gpu_bytes'] / 2**20:.0f} MiB")
        c.print(f"{r['device']} {r['tokens']:,} tokens, local window on "
                f"{'GPU' if r['gpu_local'] else 'CPU'}: prefill {r['prefill_tok_s']:,.0f} tok/s"
                f"{peak}, decode {r['decode_tok_s']:.1f} tok/s")
    return result
