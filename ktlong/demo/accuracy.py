"""`ktlong bench accuracy`: passkey, kv-retrieval and needle accuracy per profile and length.

Each document (ktlong.demo.tasks.make_mixed) hides one asked fact per task (by default a pass key,
several key-value records and one needle; `multineedle` adds several needles and asks for one) in
a haystack of filler or of generated prose; sample i of n puts the asked facts at depths
(i + 0.5) / n, shifted by 1/len(tasks) per task, so every (length, task) cell covers the depths
evenly. The questions are asked one at a time after the document, exactly as `ktlong chat` asks
them: Conversation renders the prompt, the document is prefilled (chunked; exact, windowed or
sparse as the profile's `prefill` says), and each question is appended to it. Each cell reports
its share of right answers with a Wilson 95% interval.

Selection settings do not change the KV cache, so the document is prefilled once per distinct
prefill (`prefill` and the keys of its mode, and `kv_type`) and its K, V copied into a fresh store
per profile (block_size and anchor_num set each profile's layout). Each profile then sees what a
chat under it would see: its anchors come from the vote of the document's last queries (DYNAMIC),
its preselection from the question's; answers are greedy.
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ktlong.demo import tasks

PROFILES = ("dense", "default", "quest", "kvretrieval", "streamingllm")
PEERS = ("llamacpp", "llamacpp-yarn")  # llama.cpp on the same GGUF: plain, and YaRN rope scaling
LENGTHS = (2048, 4096, 16384, 32768)
MAX_NEW_TOKENS = 24
DEPTH_BUCKETS = (("start", 0.0, 1 / 3), ("middle", 1 / 3, 2 / 3), ("end", 2 / 3, 1.01))


@dataclasses.dataclass
class Record:
    length: int  # document tokens (the prompt adds the template and the question)
    task: str
    profile: str
    depth: float
    correct: bool
    answer: str
    attended: float  # share of context blocks read per decode step
    # per question vote (question_blocks): the rank of the fact's best block among the
    # candidates, 0 first, -1 none of them (in the local window); empty: no vote or no fact found
    ranks: list[int] = dataclasses.field(default_factory=list)


def depths_for(i: int, n: int, task_names: Sequence[str] = tasks.TASKS) -> dict[str, float]:
    """Sample i of n: task -> depth of its asked fact, (i + 0.5) / n shifted by j / len(tasks)
    for the j-th task, so each task's depths cover the document evenly over the n samples."""
    base = (i + 0.5) / n
    return {t: (base + j / len(task_names)) % 1.0 for j, t in enumerate(task_names)}


def wilson(right: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a share `right` / `n` (95% for z = 1.96); (0, 1) for n = 0."""
    if n <= 0:
        return 0.0, 1.0
    p = right / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, mid - half), min(1.0, mid + half)


PREFILL_KEYS = ("prefill", "prefill_window", "init_len", "block_positions", "prefill_vertical",
                "prefill_slash", "prefill_patterns", "kv_type")


def _prefill_key(st: Any) -> tuple[Any, ...]:
    """What of a profile's settings changes the document's KV (`prefill` and its own keys, and
    the KV format: a prefill reads its own quantised past)."""
    from ktlong.config import reads_patterns, window_reads

    window = (st.prefill_window, st.init_len, st.block_positions) if window_reads(st) else ()
    patterns = (st.prefill_vertical, st.prefill_slash, st.prefill_patterns) \
        if reads_patterns(st) else ()
    return (st.prefill if window or patterns else "DENSE", *window, *patterns, st.kv_type)


def fact_span(doc_ids: Sequence[int], tok: Any, sentence: str) -> tuple[int, int] | None:
    """`[start, end)`: the token positions of `sentence` in `doc_ids`, where its tokens (less
    the first and last, which may merge with their neighbours) first occur; None if they do not."""
    import numpy as np

    ids = np.asarray(tok(" " + sentence.strip(), add_special_tokens=False)["input_ids"][1:-1])
    doc = np.asarray(doc_ids, np.int64)
    if ids.size == 0 or doc.size < ids.size:
        return None
    hit = np.flatnonzero((np.lib.stride_tricks.sliding_window_view(doc, ids.size) == ids).all(1))
    return (int(hit[0]) - 1, int(hit[0]) + ids.size + 1) if hit.size else None


def fact_rank(order: Any, span: tuple[int, int], block_size: int) -> int:
    """The place in a vote's ranking `order` ([n] block ids, best first) of the best block
    holding part of the token span; -1 when none of them is ranked."""
    import numpy as np

    blocks = np.arange(span[0] // block_size, (span[1] - 1) // block_size + 1)
    where = np.flatnonzero(np.isin(order, blocks))
    return int(where[0]) if where.size else -1


def _copy_store(src: Any, shape: Any, n: int, capacity: int) -> Any:
    """A fresh store of `shape` holding the first `n` tokens of `src` (a memcpy, no forward)."""
    from ktlong.kvstore import KVStore

    dst = KVStore(shape, capacity)
    for layer in range(shape.n_layers):
        k, v = src.token_range(layer, 0, n)
        dst.write(layer, k, v)
    dst.copy_layer_cos(src)  # the layers' similarities: layer_budget SQUEEZE reads them
    return dst


def run(model: Path | None, lengths: Sequence[int], samples: int, profiles: Sequence[str],
        seed: int = 0, threads: int = 0, report: Callable[[str], None] | None = None,
        task_names: Sequence[str] = tasks.TASKS, haystack: str = "filler",
        lead: bool = False, device: str = "AUTO",
        done: Callable[[list[Record]], None] | None = None,
        only: Sequence[int] = ()) -> list[Record]:
    """Every (length, sample, task, profile); `report` gets one line per document, `done` the
    records so far after each document.
    `task_names`: of tasks.ALL_TASKS; `haystack`: of tasks.HAYSTACKS; `lead`: each answer starts
    with the reference answer's words before the value (`Fact.lead`), given in the prompt;
    `device`: where the model runs (AUTO: CUDA when present: the prefill on the GPU, the
    block-sparse decode attention on the CPU), as in a chat; `only`: run just these samples
    (0-based) of the `samples` documents, the same documents as in the whole run."""
    from ktlong.config import resolve_settings
    from ktlong.conversation import Conversation
    from ktlong.engine import Sampling, Session
    from ktlong.fit import fit_to_model
    from ktlong.kvstore import StoreShape
    from ktlong.model import load_model
    from ktlong.recall import prefix

    lm = load_model(model or default_model(), device)
    tok = lm.tokenizer
    spec = lm.spec
    peers = [p for p in profiles if p in PEERS]
    profiles = [p for p in profiles if p not in PEERS]

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    out: list[Record] = []
    for n_tok in lengths:
        cap = n_tok + 1024
        common = {"max_seq_len": cap, "device": device, "threads_num": threads}
        per = {p: fit_to_model(resolve_settings(p, common, config_file=False), spec).settings
               for p in profiles}  # each profile's budget fitted to the model's trained context
        bases = {}  # prefill key -> the dense settings that prefill the document that way
        for st in per.values():
            if st.attention == "LOCRET":  # reads the document itself, keeping its budget
                continue
            key = _prefill_key(st)
            if key not in bases:
                over = {**common, **{k: getattr(st, k) for k in PREFILL_KEYS}}
                bases[key] = resolve_settings("dense", over, config_file=False).settings
        for i in range(samples):
            if only and i not in only:
                continue
            t0 = time.perf_counter()
            sample = tasks.make_mixed(seed * 1_000_003 + n_tok * 101 + i, n_tok,
                                      depths_for(i, samples, task_names), count=count,
                                      haystack=haystack)
            conv = Conversation(tok, sample.document)
            doc_ids = conv.document_ids()
            # per asked fact: its prompt ids (with the answer's lead) and the lead's text
            heads = [f.lead if lead else "" for f in sample.asked]
            leads = [tok(h, add_special_tokens=False)["input_ids"] if h else [] for h in heads]
            prompts = [conv.prompt_ids(f.question) + ids
                       for f, ids in zip(sample.asked, leads, strict=True)]
            spans = [fact_span(doc_ids, tok, f.sentence) for f in sample.asked]

            prefilled = {}
            for key, base in bases.items():
                s0 = Session(lm, base)
                s0.prefill(doc_ids)
                prefilled[key] = s0  # its store, and the document's last queries per layer
            prefill_s = time.perf_counter() - t0
            line = []
            for name, st in per.items():
                asks = prompts
                if st.attention == "LOCRET":
                    sess = Session(lm, st)
                    sess.prefill(doc_ids)
                    if sess.dropped and st.locret_recall:  # the passages re-read (recall.py)
                        skip = len(conv.head_ids())
                        asks = [conv.prompt_ids(prefix(tok, doc_ids, f.question,
                                                       st.locret_recall, skip)[0] + f.question)
                                + ids for f, ids in zip(sample.asked, leads, strict=True)]
                else:
                    s0 = prefilled[_prefill_key(st)]
                    # the layers the prefill's store holds (Gemma 3: its global ones)
                    shape = StoreShape(s0.store.shape.n_layers, spec.n_kv_heads, spec.head_dim,
                                       st.block_size, st.kv_type, st.anchor_num)
                    store = _copy_store(s0.store, shape, len(doc_ids), cap)
                    if s0.window is not None:  # the sliding-window layers' last rows (Gemma 3)
                        store.window_rows = s0.window.state(len(doc_ids))
                    sess = Session(lm, st, store=store, tokens=doc_ids)
                    sess.policy.on_prefill_end(s0.router.captured, len(doc_ids))
                right, ranked = 0, []
                for fact, head, prompt, span in zip(sample.asked, heads, asks, spans,
                                                    strict=True):
                    sess.policy.vote_orders.clear()
                    sess.extend_to(prompt)
                    ids, share = [], 1.0
                    for step in sess.generate(Sampling(max_new_tokens=MAX_NEW_TOKENS,
                                                       temperature=0.0)):
                        if step.token_id not in lm.eos_ids:
                            ids.append(step.token_id)
                        share = step.stats.attended_share
                    answer = head + tok.decode(ids, skip_special_tokens=True)
                    ok = tasks.is_correct(fact, answer)
                    right += ok
                    ranks = [] if span is None else [fact_rank(o, span, st.block_size)
                                                     for o in sess.policy.vote_orders]
                    if ranks:
                        ranked.append(f"{fact.kind} {' then '.join(map(str, ranks))}")
                    out.append(Record(n_tok, fact.kind, name, round(fact.depth, 3), ok, answer,
                                      round(share, 4), ranks))
                line.append(f"{name} {right}/{len(sample.asked)}"
                            + (f" (the fact's block ranked {', '.join(ranked)})" if ranked
                               else ""))
                del sess
            for name in peers:
                t1 = time.perf_counter()
                answers = _peer_answers(name, spec, prompts, threads, lm.eos_ids)
                if isinstance(answers, str):  # llama.cpp could not run: no records, one line
                    line.append(f"{name} did not run ({answers})")
                    continue
                right = 0
                for fact, head, ids in zip(sample.asked, heads, answers, strict=True):
                    answer = head + tok.decode(ids, skip_special_tokens=True)
                    ok = tasks.is_correct(fact, answer)
                    right += ok
                    out.append(Record(n_tok, fact.kind, name, round(fact.depth, 3), ok, answer,
                                      1.0))
                line.append(f"{name} {right}/{len(sample.asked)} "
                            f"({time.perf_counter() - t1:.0f}s)")
            if report:
                report(f"{n_tok} tokens, sample {i + 1}/{samples}: prefill {prefill_s:.1f}s, "
                       f"total {time.perf_counter() - t0:.1f}s; " + ", ".join(line))
            if done:
                done(out)
    return out


def _peer_answers(name: str, spec: Any, prompts: list[list[int]], threads: int,
                  eos: tuple[int, ...]) -> list[list[int]] | str:
    """llama.cpp's greedy answer ids to each prompt (one document, its questions: the second
    reuses the document's KV by prefix match), or why it could not run (its context did not
    fit). `llamacpp` reads at the model's own positions (n_ctx = the prompt); `llamacpp-yarn`
    stretches RoPE by YaRN from the trained context to n_ctx, as `llama-cli --rope-scaling yarn
    --yarn-orig-ctx` does."""
    import os

    import llama_cpp

    from ktlong.spec import trained_context

    n_ctx = max(len(p) for p in prompts) + MAX_NEW_TOKENS + 8
    kw: dict[str, Any] = {}
    trained = trained_context(spec)
    if name == "llamacpp-yarn" and n_ctx > trained:
        kw = dict(rope_scaling_type=llama_cpp.LLAMA_ROPE_SCALING_TYPE_YARN, yarn_orig_ctx=trained,
                  rope_freq_scale=trained / n_ctx)
    try:
        llm = llama_cpp.Llama(model_path=spec.path, n_ctx=n_ctx, n_batch=512,
                              n_threads=threads or os.cpu_count(), flash_attn=True,
                              n_gpu_layers=0, verbose=False, **kw)
    except (ValueError, RuntimeError, MemoryError) as e:  # e.g. "Failed to create llama_context"
        return f"n_ctx {n_ctx:,}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    out = []
    for ids in prompts:
        got: list[int] = []
        for t in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
            if int(t) in eos or len(got) == MAX_NEW_TOKENS:
                break
            got.append(int(t))
        out.append(got)
    del llm
    return out


def default_model() -> Path:
    from ktlong.demo.train import MODEL_DIR

    return MODEL_DIR


# --- summaries ---------------------------------------------------------------------------------
def summarise(records: Sequence[Record]) -> dict[str, Any]:
    """{"cells": {(length, task, profile): [right, n]},
    "depth": {(length, profile, bucket): [right, n]}}"""
    cells: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    depth: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for r in records:
        c = cells[(r.length, r.task, r.profile)]
        c[0] += r.correct
        c[1] += 1
        for name, lo, hi in DEPTH_BUCKETS:
            if lo <= r.depth < hi:
                d = depth[(r.length, r.profile, name)]
                d[0] += r.correct
                d[1] += 1
    return {"cells": dict(cells), "depth": dict(depth)}


def summary(records: Sequence[Record]) -> list[dict[str, Any]]:
    """One entry per (length, task, profile) cell: right, n, pct and its Wilson 95% interval
    (`ci95`, in % as pct is), in the order of the records."""
    out = []
    for (length, task, profile), (right, n) in summarise(records)["cells"].items():
        lo, hi = wilson(right, n)
        out.append({"length": length, "task": task, "profile": profile, "right": right, "n": n,
                    "pct": round(100 * right / n, 1),
                    "ci95": [round(100 * lo, 1), round(100 * hi, 1)]})
    return out


def _pct(c: list[int]) -> str:
    """`95 (76-99)`: % right and its Wilson 95% interval."""
    if not c[1]:
        return "-"
    lo, hi = wilson(c[0], c[1])
    return f"{100 * c[0] / c[1]:.0f} ({100 * lo:.0f}-{100 * hi:.0f})"


def _task_order(records: Sequence[Record]) -> list[str]:
    present = {r.task for r in records}
    return [t for t in tasks.ALL_TASKS if t in present] + sorted(present - set(tasks.ALL_TASKS))


def markdown(records: Sequence[Record], command: str) -> str:
    s = summarise(records)
    lengths = sorted({r.length for r in records})
    profiles = list(dict.fromkeys(r.profile for r in records))
    task_names = _task_order(records)
    n = max((c[1] for c in s["cells"].values()), default=0)
    lines = [f"`{command}`", "",
             f"Accuracy in %, Wilson 95% interval in brackets ({n} samples per cell; greedy "
             "answers must contain the hidden value).",
             "", "| length | task | " + " | ".join(profiles) + " |",
             "|---:|---|" + "---:|" * len(profiles)]
    for L in lengths:
        for t in task_names:
            row = [_pct(s["cells"].get((L, t, p), [0, 0])) for p in profiles]
            lines.append(f"| {_k(L)} | {t} | " + " | ".join(row) + " |")
    lines += ["", "By depth of the asked fact (all tasks; thirds of the document):",
              "", "| length | depth | " + " | ".join(profiles) + " |",
              "|---:|---|" + "---:|" * len(profiles)]
    for L in lengths:
        for name, _, _ in DEPTH_BUCKETS:
            row = [_pct(s["depth"].get((L, p, name), [0, 0])) for p in profiles]
            lines.append(f"| {_k(L)} | {name} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


DEPTH_BINS = 5  # rows of the plotted grid, fewer when a cell has fewer samples


def plot(data: dict[str, Any], path: Path | str) -> Any:
    """The accuracy grid: per task (columns) and profile (rows), document length across and the
    asked fact's depth down, each cell coloured by its share of right answers and labelled with
    it in %. `data` is the --json output (records as dicts). Returns the figure."""
    import numpy as np

    from ktlong.bench import plot as plotting

    records = [Record(**r) if isinstance(r, dict) else r for r in data["records"]]
    lengths = sorted({r.length for r in records})
    profiles = list(dict.fromkeys(r.profile for r in records))
    task_names = _task_order(records)
    per_cell: dict[tuple, list[Record]] = defaultdict(list)
    for r in records:
        per_cell[(r.length, r.task, r.profile)].append(r)
    bins = max(1, min(DEPTH_BINS, max((len(v) for v in per_cell.values()), default=1)))
    labels = [f"{100 * i // bins}-{100 * (i + 1) // bins}%" for i in range(bins)]
    rows, cols = len(profiles), len(task_names)
    w = max(3.0, 0.75 * len(lengths) + 1.4)
    fig, axes = plotting.figure(
        cols + 1, rows, size=(cols * w + 1.0, rows * max(2.4, 0.45 * bins + 1.4) + 1.4),
        gridspec_kw={"width_ratios": [1.0] * cols + [0.06]})
    import matplotlib

    cmap = matplotlib.colormaps["RdYlGn"].with_extremes(bad="#dddddd")
    image = None
    for i, p in enumerate(profiles):
        for j, t in enumerate(task_names):
            right = np.zeros((bins, len(lengths)))
            n = np.zeros((bins, len(lengths)))
            for x, L in enumerate(lengths):
                for r in per_cell.get((L, t, p), []):
                    y = min(bins - 1, int(r.depth * bins))
                    right[y, x] += r.correct
                    n[y, x] += 1
            share = np.divide(right, n, out=np.full_like(right, np.nan), where=n > 0)
            ax = axes[i][j]
            image = ax.imshow(np.ma.masked_invalid(share), cmap=cmap, vmin=0, vmax=1,
                              aspect="auto")
            for (y, x), v in np.ndenumerate(share):  # white on the dark ends of the map
                ax.text(x, y, "-" if np.isnan(v) else f"{100 * v:.0f}", ha="center",
                        va="center", fontsize=9,
                        color="white" if not np.isnan(v) and (v > 0.85 or v < 0.15) else "black")
            ax.set_xticks(range(len(lengths)), [plotting.tokens(L) for L in lengths])
            ax.set_yticks(range(bins), labels if j == 0 else [""] * bins)
            ax.tick_params(left=j == 0)
            if i == 0:
                ax.set_title(t, fontsize=10)
            if i == rows - 1:
                ax.set_xlabel("document tokens")
            if j == 0:
                ax.set_ylabel(f"{Path(p).name}\ndepth of the asked fact" if rows > 1 else
                              "depth of the asked fact")
        cax = axes[i][cols]
        if i == 0 and image is not None:
            fig.colorbar(image, cax=cax, label="correct share")
            cax.yaxis.set_major_formatter(lambda v, _: f"{100 * v:.0f}%")
        else:
            cax.set_axis_off()
    n_max = max((len(v) for v in per_cell.values()), default=0)
    n_min = min((len(v) for v in per_cell.values()), default=0)
    answers = f"{n_min}-{n_max}" if n_min < n_max else f"{n_max}"
    title = (f"accuracy by length and depth ({answers} answers per task and length"
             + (f", profile {Path(profiles[0]).name}" if rows == 1 and profiles else "")
             + (f", {data['haystack']} haystack" if data.get("haystack", "filler") != "filler"
                else "")
             + "; cell: % right)")
    return plotting.finish(fig, path, title, data)


def main(model: Path | None, lengths: Sequence[int], samples: int, profiles: Sequence[str],
         as_json: bool = False, plot_file: Path | None = None, threads: int = 0, seed: int = 0,
         command: str = "ktlong bench accuracy", task_names: Sequence[str] = tasks.TASKS,
         haystack: str = "filler", lead: bool = False, device: str = "AUTO",
         save: Path | None = None, only: Sequence[int] = ()) -> None:
    """Run, then print the result (JSON or a table) and draw it; with `save`, the JSON is also
    written there after every document (atomically: a stopped run keeps what it measured,
    marked `"complete": false`)."""
    from rich.console import Console

    from ktlong.bench import plot as plotting
    from ktlong.configfile import atomic_write
    from ktlong.model import pick_device

    if plot_file is not None:
        plotting.require()
    err = Console(stderr=True)
    head = {"bench": "accuracy", "command": command, "machine": plotting.machine(),
            "device": pick_device(device).type, "threads": threads or "auto (idle cores)",
            "model": str(model) if model else "ktlong's demo model",
            "haystack": haystack, "tasks": list(task_names), "lead": lead}

    def result(records: list[Record], complete: bool) -> dict[str, Any]:
        return {**head, "complete": complete,
                "records": [dataclasses.asdict(r) for r in records], "summary": summary(records)}

    def keep(records: list[Record], complete: bool = False) -> None:
        try:
            atomic_write(save, json.dumps(result(records, complete)))
        except OSError as e:  # the run goes on: its result still prints at the end
            err.print(f"warning: --save {save}: {e.strerror or e}; the run goes on",
                      highlight=False, soft_wrap=True)

    records = run(model, lengths, samples, profiles, seed, threads,
                  report=lambda line: err.print(line, highlight=False), task_names=task_names,
                  haystack=haystack, lead=lead, device=device, done=keep if save else None,
                  only=only)
    data = result(records, True)
    if save is not None:
        keep(records, complete=True)
    if plot_file is not None:
        plot(data, plot_file)
    if as_json:
        print(json.dumps(data))
    else:
        print(markdown(records, command))
    sys.stdout.flush()
