"""`ktlong bench step`: where a decode step's time goes on a model, against its byte limit.

The model reads a real-prose prompt of `context` tokens (ktlong.bench.prose) under a profile,
then decodes `steps` greedy tokens `runs` times from the same point while every call of the
decode step (ktlong.decoder) is timed by kind: the attention's GEMVs (q, k, v, o), the MLP's
(gate, up, down), attention over the KV cache (the router), the output head, the rest of the
step (embedding row, norms, RoPE, residual adds: the step's time less the timed calls), and what
lies outside the step (sampling and the engine's bookkeeping: a token's time less its step).
The byte limit is what a step must read (every layer's weights, the head, the KV rows it
attends) over the streaming read bandwidth, measured on as many bytes in the same process.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

PARTS = ("attention GEMVs", "MLP GEMVs", "attention", "output head", "norms, RoPE, rest",
         "outside the step")


def _timed(fn: Any, acc: dict[str, float], key: str) -> Any:
    def run(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t
    return run


def _linear_bytes(mod: Any) -> int:
    """Bytes a GEMV over `mod`'s weight reads."""
    from ktlong.weights import HalfLinear, QuantLinear

    if isinstance(mod, QuantLinear):
        return int(mod.raw.nbytes)
    if isinstance(mod, HalfLinear):
        return int(mod._np.nbytes)
    w = getattr(mod, "weight", None)
    return int(w.numel() * w.element_size()) if w is not None else 0


def weight_bytes(lm: Any) -> int:
    """Bytes of every linear layer a decode step reads: the layers' and the output head's."""
    from torch import nn

    from ktlong.weights import HalfLinear, QuantLinear

    kinds = (QuantLinear, HalfLinear, nn.Linear)
    body = lm.model.model
    total = sum(_linear_bytes(m) for m in body.layers.modules() if isinstance(m, kinds))
    return total + _linear_bytes(lm.model.lm_head)


def measure(model: str, context: int, steps: int, runs: int, profile: str,
            threads: int) -> dict[str, Any]:
    from ktlong.bench import prose
    from ktlong.bench.decode import _stream
    from ktlong.config import resolve_settings
    from ktlong.engine import Sampling, Session
    from ktlong.fit import fit_to_model
    from ktlong.model import load_model

    lm = dataclasses.replace(load_model(model, device="CPU"), eos_ids=())  # always `steps`
    st = fit_to_model(resolve_settings(profile, {
        "threads_num": threads, "max_seq_len": context + runs * steps + 64, "device": "CPU"},
        config_file=False), lm.spec).settings
    session = Session(lm, st)  # compiles (or loads) its kernels here, before any timing
    if session.decoder is None:
        from ktlong.errors import KtlongError

        raise KtlongError(f"{model}: ktlong's decode step does not cover this model",
                          hint="its decode runs transformers' modules; bench e2e times it")
    ids = prose.ids(lm.tokenizer, context)
    session.prefill(ids)
    acc: dict[str, float] = defaultdict(float)
    dec = session.decoder
    dec.rope(context)  # the first step's RoPE tables, not timed: a token's time leaves it out too
    dec.layers = [dataclasses.replace(p, **{
        name: _timed(getattr(p, name), acc, "attention GEMVs" if name in ("qk", "v", "o")
                     else "MLP GEMVs")
        for name in ("qk", "v", "o", "gate_up", "down")}) for p in dec.layers]
    dec.head = _timed(dec.head, acc, "output head")
    session.router.attend_one = _timed(session.router.attend_one, acc, "attention")
    step = dec.step

    def counted(*a: Any) -> Any:
        acc["calls"] += 1
        return step(*a)
    dec.step = _timed(counted, acc, "step")
    runs_out, shares = [], []
    for r in range(runs):
        if r:  # the prompt again: its last token re-fed over the kept KV of the rest
            session.truncate(context - 1)
            session.prefill(ids[-1:])
        stamps: list[float] = []
        for s in session.generate(Sampling(max_new_tokens=steps, temperature=0.0)):
            if not stamps:  # count the calls between the first stamp and the last only: the
                acc.clear()  # same steps the token's time spans (not the first, after a prefill)
            stamps.append(time.perf_counter())
            shares.append(s.stats.attended_share)
        # ktlong feeds each token before yielding it, but not the last
        token_s = (stamps[-1] - stamps[0]) / (len(stamps) - 2)
        per = {k: acc[k] / acc["calls"] for k in (*PARTS[:4], "step")}
        runs_out.append((token_s, per))
    token_s, mid = sorted(runs_out, key=lambda r: r[0])[runs // 2]
    parts = {k: mid[k] for k in PARTS[:4]}
    parts["norms, RoPE, rest"] = max(0.0, mid["step"] - sum(parts.values()))
    parts["outside the step"] = max(0.0, token_s - mid["step"])
    share = statistics.median(shares)
    store = session.store
    kv_bytes = int(store.nbytes_used() * share)  # the store's layers: the blocks a step reads
    if session.window is not None:  # sliding-window layers: their window's rows
        spec = lm.spec
        rows = min(spec.sliding_window, context + steps)
        row = spec.n_kv_heads * spec.head_dim * session.window.kb[spec.sliding_layers[0]].itemsize
        kv_bytes += 2 * len(spec.sliding_layers) * row * rows
    wbytes = weight_bytes(lm)
    probe = np.ones((wbytes + kv_bytes) // 8, np.uint64)
    _stream(probe)
    stream_s = min(_timed_once(lambda: _stream(probe)) for _ in range(5))
    return dict(
        bench="step", model=str(lm.spec.path), profile=profile, context=context, steps=steps,
        runs=runs, threads=session.threads, token_ms=1e3 * token_s, tok_s=1 / token_s,
        parts_ms={k: 1e3 * v for k, v in parts.items()}, weight_bytes=wbytes, kv_bytes=kv_bytes,
        attended_share=share, stream_gbps=probe.nbytes / stream_s / 1e9,
        limit_ms=1e3 * stream_s, of_limit=stream_s / token_s)


def _timed_once(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(model: str, context: int, steps: int, runs: int, profile: str, threads: int,
         as_json: bool, command: str) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    data = measure(model, context, steps, runs, profile, threads)
    data["command"] = command
    if as_json:
        print(json.dumps(data))
        return
    console = Console()
    table = Table(box=box.SIMPLE_HEAD, title=f"{Path(data['model']).name}: a decode step at "
                  f"{context:,} tokens ({profile}, {data['threads']} threads)")
    table.add_column("part")
    table.add_column("ms / token", justify="right")
    table.add_column("share", justify="right")
    for k, v in data["parts_ms"].items():
        table.add_row(k, f"{v:.2f}", f"{v / data['token_ms']:.0%}")
    table.add_row("token", f"{data['token_ms']:.2f}", f"{data['tok_s']:.1f} tok/s")
    console.print(table)
    console.print(
        f"byte limit: {(data['weight_bytes'] + data['kv_bytes']) / 1e6:.1f} MB a step "
        f"(weights {data['weight_bytes'] / 1e6:.1f}, KV {data['kv_bytes'] / 1e6:.1f}) at "
        f"{data['stream_gbps']:.1f} GB/s = {data['limit_ms']:.2f} ms; the step takes "
        f"{data['of_limit']:.0%} of its time at that limit", highlight=False)
