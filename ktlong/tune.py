"""`ktlong tune prefill`: choose each query head's MInference pattern for a model, offline.

A sample document is prefilled exactly; the last `queries` prompt queries of every layer are
kept. For each layer and candidate pattern, the pattern's index is built as a MINFERENCE prefill
would build it for those queries (as one chunk at the end of the document), and each head's
recall is measured: the share of the exact attention probability that the index keeps, averaged
over the queries. Candidates cost about the same (`budget` keys a query, as MInference's search
equalises FLOPs): A-shape, Vertical-Slash at five splits of the budget, Block-Sparse. Each head
takes the candidate of highest recall; the plan is written next to the model's settings
(`$KTLONG_HOME/patterns/<model>-<fingerprint>.yaml`), where a MINFERENCE prefill finds it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ktlong.config import Settings
from ktlong.errors import KtlongError
from ktlong.minference import HeadPattern, Plan, build_index, tuned_path, write_plan


def candidates(budget: int) -> list[HeadPattern]:
    """Patterns of about `budget` keys a query (see HeadPattern.cost)."""
    b = max(budget, 256)
    out = [HeadPattern("ashape", 128, b - 160)]
    for v in (30, b // 8, b // 3, 2 * b // 3, b - 128):
        out.append(HeadPattern("vs", v, max(64, b - 64 - v)))
    out.append(HeadPattern("block", max(1, b // 64 - 2)))
    return out


def head_recall(probs: np.ndarray, index: Any, h: int, q_start: int) -> float:
    """Mean over rows of the probability mass of probs [R, n] (head h's exact attention of the
    queries at q_start..) that index keeps."""
    from ktlong.kernels import prefill_index as pi

    pos, cnt = pi.index_positions(index, h)
    dg, dcnt = pi.index_diags(index, h)
    n = probs.shape[1]
    kept = []
    for b in range(pos.shape[0]):
        rows = probs[b * pi.QB: (b + 1) * pi.QB]
        held = pos[b, : cnt[b]]
        mass = rows[:, held].sum(1)  # the causal mask zeroed the future
        if dcnt[b]:  # lone diagonals: each row's own keys, less those the block holds
            key = q_start + b * pi.QB + np.arange(rows.shape[0])[:, None] - dg[b, : dcnt[b]]
            ok = key >= 0
            ok[ok] = ~np.isin(key[ok], held)
            mass += np.where(ok, np.take_along_axis(rows, key.clip(0, n - 1), 1), 0).sum(1)
        kept.append(mass)
    return float(np.concatenate(kept).mean())


def dense_probs(q: np.ndarray, k: np.ndarray, q_start: int, scale: float) -> np.ndarray:
    """Exact causal softmax of q [R, d] (positions q_start..) over k [n, d] -> [R, n] float32."""
    s = (q @ k.T) * scale
    n = k.shape[0]
    s[np.arange(n)[None, :] > q_start + np.arange(q.shape[0])[:, None]] = -np.inf
    s -= s.max(1, keepdims=True)
    p = np.exp(s)
    return (p / p.sum(1, keepdims=True)).astype(np.float32)


def search(lm: Any, settings: Settings, ids: list[int], budget: int, queries: int,
           progress: Any = None) -> tuple[Plan, list[list[dict[str, float]]]]:
    """The best candidate per (layer, head) and each candidate's recall [layer][head]."""
    import dataclasses

    from ktlong.engine import Session
    from ktlong.kernels import prefill_index as pi
    from ktlong.kernels import prefill_sparse as ps

    spec = lm.spec
    n = len(ids)
    r = min(queries, n) // pi.QB * pi.QB
    if r < pi.QB or n < 2 * r:
        raise KtlongError(f"the sample document has {n:,} tokens: too short to tune on",
                          hint=f"use a document of at least {2 * max(queries, pi.QB):,} tokens")
    st = dataclasses.replace(settings, prefill="DENSE", attention="DENSE", kv_type="FP32",
                             max_seq_len=n + 16)
    sess = Session(lm, st)
    sess.capture_queries = r
    sess.prefill(ids, progress)
    captured = sess.router.captured  # layer -> [Hq, r, d]
    cands = candidates(budget)
    default = HeadPattern("vs", settings.prefill_vertical, settings.prefill_slash)
    cands += [default] if default not in cands else []  # the untuned plan, for comparison
    scale = spec.head_dim ** -0.5
    q_start = n - r
    g = spec.n_heads // spec.n_kv_heads
    plan, table = [], []
    for layer in range(len(spec.kv_layers)):
        kv = sess.store.kernel_views(layer)[0]
        k = sess.store.token_range(layer, 0, n)[0].numpy()  # [Hkv, n, d]
        q = captured[layer].numpy()  # [Hq, r, d]
        pooled = ps.pool_keys(kv, 0, -(-n // pi.QB), n)
        probs = [dense_probs(q[h], k[h // g], q_start, scale) for h in range(spec.n_heads)]
        rec = [dict.fromkeys([c.text() for c in cands], 0.0) for _ in range(spec.n_heads)]
        for c in cands:
            index = build_index((c,) * spec.n_heads, kv, q, q_start, scale, pooled)
            for h in range(spec.n_heads):
                rec[h][c.text()] = head_recall(probs[h], index, h, q_start)
        best = tuple(max(cands, key=lambda c, h=h: rec[h][c.text()])
                     for h in range(spec.n_heads))
        plan.append(best)
        table.append(rec)
    return Plan(tuple(plan), "tuned"), table


def main(model: Path | None, prompt_file: str | None, settings: Settings, tokens: int,
         budget: int, queries: int, out: Path | None, as_json: bool) -> dict[str, Any]:
    from ktlong import chatui, render
    from ktlong.conversation import Conversation
    from ktlong.model import load_model
    from ktlong.spec import read_spec

    if model is None:
        from ktlong.demo.accuracy import default_model

        model = default_model()
    read_spec(model)
    ui = chatui.TerminalUI(as_json=as_json)
    with ui.loading(model):
        lm = load_model(model, "CPU")
    if prompt_file:
        from ktlong.documents import read_document

        text, name = read_document(prompt_file).text, prompt_file
    else:
        from ktlong.demo import tasks

        def count(t: str) -> int:
            return len(lm.tokenizer(t, add_special_tokens=False)["input_ids"])

        text = tasks.make_mixed(7, tokens, {"passkey": 0.5, "kv": 0.2, "needle": 0.8},
                                count=count).document
        name = f"a generated {tokens:,}-token demo document"
    ids = Conversation(lm.tokenizer, text).document_ids()[:tokens]
    with ui.progress("prefilling the sample") as progress:
        plan, table = search(lm, settings, ids, budget, queries, progress)
    path = out or tuned_path(lm.spec)
    kinds = [p.kind for row in plan.layers for p in row]
    best = [max(h.values()) for rec in table for h in rec]
    default = HeadPattern("vs", settings.prefill_vertical, settings.prefill_slash).text()
    dflt = [h.get(default) for rec in table for h in rec]
    header = (f"ktlong prefill patterns, written by `ktlong tune prefill` from {name}\n"
              f"({len(ids):,} tokens, the last {min(queries, len(ids))} queries, {budget} keys a "
              f"query). Mean recall of the exact attention: {np.mean(best):.3f}.\n"
              "One line per layer, one pattern per query head: 'ashape INIT LOCAL', "
              "'vs VERTICAL SLASH' or 'block K'.")
    write_plan(path, lm.spec, plan, header)
    result = {
        "file": str(path), "tokens": len(ids), "budget": budget,
        "heads": {k: kinds.count(k) for k in ("ashape", "vs", "block")},
        "mean_recall": float(np.mean(best)),
        "per_layer_recall": [float(np.mean([max(h.values()) for h in rec])) for rec in table],
        "candidates": table,
    }
    if as_json:
        render.print_json(result)
    else:
        c = render.console(stderr=True)
        c.print(f"tuned on {name} ({len(ids):,} tokens): "
                + ", ".join(f"{v} {k}" for k, v in result["heads"].items()) + " heads; "
                f"mean recall {result['mean_recall']:.3f}"
                + (f" (every head {default}: {np.mean(dflt):.3f})" if None not in dflt else ""))
        c.print(f"patterns: {path}")
    return result
