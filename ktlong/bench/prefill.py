"""`ktlong bench prefill`: ktlong's chunked prefill per prefill mode (dense, window, minference),
and against transformers' one-shot forward.

Each measurement runs in a fresh subprocess so its peak RSS is its own; runs are interleaved per
context length. The model is a small random Llama built locally (`--shape small`, no downloads),
a random Llama of Llama-3-8B's widths with 2 layers (`--shape 8b`), or `--model`. Reported per
run: whole-prefill seconds and tok/s, and the part spent in attention (for minference also the
part spent estimating patterns and building indexes, and the (query, key) pairs its sparse chunks
compute as a share of dense attention's, "keys read", of them the lone diagonals' share).
Compiled kernels are loaded before timing.

`--sample-chunks S` (for shapes too slow to prefill whole): instead of every chunk, S chunks at
the middle of S equal spans of the context are prefilled, each after the store was filled with
random K, V (N(0, 1), BF16) up to its start; every figure is the sampled chunks' mean times the
number of chunks. Prefill cost per chunk is linear in its start (dense) or flatter (window,
minference), so the midpoint rule estimates a linear cost exactly. Random K, V have no structure
for Vertical-Slash to follow: its diagonals scatter, each read as a lone diagonal (a real model's
diagonals gather near the query, where they are read as ranges).

`--peers llamacpp-fa,llamacpp-nofa` (a GGUF `--model`): llama.cpp (llama-cpp-python, flash
attention on or off, F16 KV, n_batch and n_ubatch 512) reads the same ids of the same file in a
child process with the peers' environment. Sampled, it is timed on the same chunks: for each, a
synthetic KV state of random tokens up to the chunk's start (ktlong.bench.llamastate) is loaded
with `llama_state_seq_set_data`, then the chunk's tokens are decoded at their positions (two
batches of 512 for a chunk of 1,024), and the times are scaled as ktlong's are.

Against the arithmetic limit: the machine's peak of each dot-product instruction ktlong's prefill
matmuls can run on (AVX512-VNNI `vpdpbusd`, AMX `tdpbusd` and `tdpbf16ps`, AVX2 `vpmaddubsw`;
kernels/qmatmul.py's `peak`, every thread on registers or tiles alone) is measured once per run;
each ktlong row gives the precision of its matmuls (INT8, BF16, FP32), the operations its
linear layers take a token (2 x the weights of the decoder layers), the rate it ran them at
outside attention, and that rate's share of the peak of the instruction the precision runs on
("of limit"). "128K s" projects the time to read 131,072 tokens of the loaded model from the
run: its time outside attention per token times 131,072, plus its attention time scaled by
(131,072 / context) squared (dense) or linearly (window, minference: past the window each token
reads about as much); a run at 128K reports itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ktlong.bench import peer_env
from ktlong.bench.rss import peak_rss
from ktlong.config import CHUNK_AUTO

SHAPES = {
    "small": dict(layers=4, hidden=512, heads=8, kv_heads=2, head_dim=64, intermediate=1408),
    # Llama-3-8B's widths (GQA 32/8, head_dim 128), 2 layers
    "8b": dict(layers=2, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336),
}
BENCH_SHAPE = SHAPES["small"]
MODES = ("dense", "window", "minference")
PEERS = ("llamacpp-fa", "llamacpp-nofa")  # llama.cpp, flash attention on / off, F16 KV
PEER_BATCH = 512  # llama.cpp's n_batch and n_ubatch (the e2e comparisons')


def sample_points(n: int, chunk: int, sample: int) -> list[int]:
    """The chunks a sampled run times (their indices): the middle one of each of `sample` equal
    spans of the context's chunks."""
    n_chunks = -(-n // chunk)
    return [int((i + 0.5) * n_chunks / sample) for i in range(sample)]


def scale(chunk_s: list[float], n: int, chunk: int) -> float:
    """A sampled run's estimate of the whole read: the timed chunks' mean x the chunks."""
    return sum(chunk_s) / len(chunk_s) * -(-n // chunk)


def _warm(kv_kind: int) -> None:
    """Load (or compile) the sparse prefill kernels for this KV type before timing."""
    import numpy as np

    from ktlong import kernels
    from ktlong.kernels import prefill_index as pi
    from ktlong.kernels import prefill_sparse as ps

    z = np.zeros((1, 4, 64, 32), np.float32)
    k = kernels.f32_to_kv(z, kv_kind)
    kv = kernels.layer_kv(k[:, :0], k[:, :0], k, k.copy(), 0, kv_kind)
    q = np.zeros((1, 64, 32), np.float32)
    ps.sparse_attend(kv, q, 0, pi.dense_index(1, 0, 64), 1.0)
    ps.vs_estimate(kv, q, np.zeros(1, np.int64), 64, 1.0)
    ps.pool_keys(kv, 0, 1, 64)
    pi.vs_index(np.zeros((1, 1), np.int32), np.zeros((1, 1), np.int32), 0, 64, pi.LONE_COST)
    pi.block_index(np.zeros((1, 1, 1), np.float32), 0, 64, 1)


def _fill_random(sess: Any, upto: int, seed: int) -> None:
    """Append random K, V to every layer of the store up to `upto` tokens (sampled runs)."""
    import torch

    store = sess.store
    have = store.length
    if upto <= have:
        return
    sh = store.shape
    g = torch.Generator().manual_seed(seed)
    for layer in range(sh.n_layers):
        for t0 in range(have, upto, 8192):
            n = min(upto, t0 + 8192) - t0
            store.write(layer, torch.randn(sh.n_kv_heads, n, sh.head_dim, generator=g),
                        torch.randn(sh.n_kv_heads, n, sh.head_dim, generator=g))


def _worker(runtime: str, model: str, n: int, threads: int, chunk: int, sample: int
            ) -> dict[str, Any]:
    if runtime in PEERS:
        return _llamacpp(runtime, model, n, threads, chunk, sample)
    import torch

    from ktlong.model import load_model
    from ktlong.tinymodel import filler_text

    torch.set_num_threads(threads)
    lm = load_model(model, device="CPU")
    ids = lm.tokenizer(filler_text(n, seed=0))["input_ids"][:n]
    assert len(ids) == n, "filler text too short"
    row: dict[str, Any] = {"runtime": runtime, "context": n, "chunk_size": chunk,
                           "sampled_chunks": sample}
    if runtime.startswith("ktlong"):
        from ktlong import kernels
        from ktlong.config import resolve_settings
        from ktlong.engine import Session
        from ktlong.fit import fit_to_model
        from ktlong.warmup import work_clock

        mode = runtime.split("-", 1)[1].upper()
        st = fit_to_model(resolve_settings(None, {  # the window a chat gets: fitted to the model
            "attention": "DENSE", "prefill": mode, "kv_type": "BF16", "chunk_size": chunk,
            "max_seq_len": n + 16, "threads_num": threads}, config_file=False), lm.spec).settings
        kernels.configure_threads(threads)
        _warm(1)
        sess = Session(lm, st)
        attn = index = 0.0
        pairs = [0, 0, 0]  # sparse chunks: (query, key) pairs in tiles, lone; dense's

        def tally() -> float:
            ca = sess.router.chunk_attention
            if ca is None:
                return 0.0
            pairs[0] += ca.pairs
            pairs[1] += ca.lone_pairs
            pairs[2] += ca.dense_pairs
            return ca.index_s

        row.update(matmul=sess.prefill_matmul, linear_ops=linear_ops(lm.model))
        if not sample:
            t0 = work_clock()  # imports done, as for transformers below; compiling left out
            sess.prefill(ids)
            dt = work_clock() - t0
            attn = sess.router.attn_s
            index = tally()
        else:
            picks, chunk_s = sample_points(n, chunk, sample), []
            for c in picks:
                _fill_random(sess, c * chunk, seed=c)
                sess.tokens = list(ids[: c * chunk])  # the random K, V stand for these
                t0 = work_clock()
                sess.prefill(ids[c * chunk: (c + 1) * chunk])
                chunk_s.append(work_clock() - t0)
                attn += sess.router.attn_s
                index += tally()
            dt = scale(chunk_s, n, chunk)
            f = dt / sum(chunk_s)
            attn, index = attn * f, index * f
            row.update(sampled_at=[c * chunk for c in picks], chunk_s=chunk_s)
        row.update(prefill=mode.lower(), attention_s=attn, index_s=index,
                   keys_read=(pairs[0] + pairs[1]) / pairs[2] if pairs[2] else None,
                   lone_read=pairs[1] / pairs[2] if pairs[2] else None)
    else:
        from transformers import AutoModelForCausalLM

        stock = AutoModelForCausalLM.from_pretrained(model, attn_implementation="sdpa").eval()
        t0 = time.perf_counter()
        with torch.inference_mode():
            stock(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        dt = time.perf_counter() - t0
        row.update(prefill="dense", attention_s=None, index_s=None, keys_read=None,
                   lone_read=None)
    row.update(prefill_s=dt, prefill_tok_s=n / dt, peak_rss_bytes=peak_rss())
    return row


def _llamacpp(runtime: str, model: str, n: int, threads: int, chunk: int, sample: int
              ) -> dict[str, Any]:
    """llama.cpp's prefill of the ids `_worker` reads: whole from an empty cache, or the
    sampled chunks, each over a synthetic KV state of random tokens up to its start."""
    import llama_cpp

    from ktlong.bench import llamastate
    from ktlong.bench.e2e import LLAMACPP_KV
    from ktlong.model import load_tokenizer
    from ktlong.spec import read_spec
    from ktlong.tinymodel import filler_text

    flash, ggml_type = LLAMACPP_KV[runtime]
    ids = load_tokenizer(model)(filler_text(n, seed=0))["input_ids"][:n]
    assert len(ids) == n, "filler text too short"
    picks = sample_points(n, chunk, sample) if sample else []
    end = min(n, (picks[-1] + 1) * chunk) if picks else n  # the last token read
    llm = llama_cpp.Llama(
        model_path=model, n_ctx=end, n_batch=PEER_BATCH, n_ubatch=PEER_BATCH,
        n_threads=threads, n_threads_batch=threads, flash_attn=flash, type_k=ggml_type,
        type_v=ggml_type, n_gpu_layers=0, verbose=False)
    llm.eval(ids[:64])  # not timed: the weights paged in, the threads started
    spec = read_spec(model)
    row: dict[str, Any] = {"runtime": runtime, "context": n, "chunk_size": chunk,
                           "sampled_chunks": sample, "batch": PEER_BATCH, "prefill": "dense",
                           "attention_s": None, "index_s": None, "keys_read": None,
                           "lone_read": None}
    chunk_s = []
    for p, q in [(c * chunk, min(n, (c + 1) * chunk)) for c in picks] or [(0, n)]:
        llm._ctx.kv_cache_clear()
        llm.n_tokens = 0
        if p:
            llamastate.load(llm, spec, p, flash, ggml_type, seed=p // chunk)
            llm.n_tokens = p  # what llama-cpp-python then believes the cache holds
        t0 = time.perf_counter()
        llm.eval(ids[p:q])  # at positions p..q-1, in batches of PEER_BATCH
        chunk_s.append(time.perf_counter() - t0)
    mem = llama_cpp.llama_get_memory(llm.ctx)  # the cache after the last chunk: p + its tokens
    row["cache_end"] = llama_cpp.llama_memory_seq_pos_max(mem, 0) + 1
    dt = scale(chunk_s, n, chunk) if sample else chunk_s[0]
    if sample:
        row.update(sampled_at=[c * chunk for c in picks], chunk_s=chunk_s)
    row.update(prefill_s=dt, prefill_tok_s=n / dt, peak_rss_bytes=peak_rss())
    return row


def linear_ops(model: Any) -> int:
    """Operations (a multiply and an add each) of the decoder layers' linear maps for one token:
    2 x their weights (the output head, run for the last token only, left out)."""
    from torch import nn

    from ktlong.weights import HalfLinear, QuantLinear

    head = model.get_output_embeddings()
    return sum(2 * m.in_features * m.out_features for m in model.modules()
               if isinstance(m, (nn.Linear, HalfLinear, QuantLinear)) and m is not head)


# the instruction each prefill precision runs on, best first (kernels/qmatmul.py: PEAK_KINDS)
LIMIT_OF = {"INT8": ("amx-int8", "vnni", "avx2"), "BF16": ("amx-bf16",)}
TARGET = 131072  # tokens of the projected read


def peaks(threads: int) -> dict[str, float]:
    """Ops/s of each dot-product instruction this CPU has, on `threads` threads."""
    from ktlong import kernels
    from ktlong.kernels import qmatmul

    kernels.configure_threads(threads)
    return {k: qmatmul.peak(k, threads) for k in qmatmul.peak_kinds()}


def against_limit(row: dict[str, Any], peak: dict[str, float]) -> None:
    """Add to a ktlong row: the linear layers' rate outside attention, the peak it is held
    against (of the instruction its precision runs on), the share, and the projected 128K s."""
    n, outside = row["context"], row["prefill_s"] - row["attention_s"]
    row["linear_ops_s"] = row["linear_ops"] * n / outside if outside > 0 else None
    kind = next((k for k in LIMIT_OF.get(row["matmul"], ()) if k in peak), None)
    row["limit"] = kind
    row["limit_ops_s"] = peak.get(kind) if kind else None
    row["of_limit"] = (row["linear_ops_s"] / row["limit_ops_s"]
                       if row["limit_ops_s"] and row["linear_ops_s"] else None)
    f = TARGET / n
    attn = row["attention_s"] * (f * f if row["prefill"] == "dense" else f)
    row["projected_128k_s"] = outside * f + attn


def main(contexts: list[int], threads: int, as_json: bool, model: Path | None = None,
         chunk_sizes: tuple[int, ...] = (CHUNK_AUTO[False],), modes: tuple[str, ...] = ("dense",),
         transformers: bool = True, shape: str = "small", sample: int = 0,
         command: str = "", plot_file: Path | None = None, peers: tuple[str, ...] = ()) -> None:
    from rich.console import Console
    from rich.table import Table

    from ktlong.bench import plot as plotting
    from ktlong.tinymodel import make_model

    if plot_file is not None:
        plotting.require()

    threads = threads or __import__("os").cpu_count() or 1
    tmp = None
    dims = SHAPES[shape]
    if model is None:
        tmp = tempfile.TemporaryDirectory(prefix="ktlong-bench-")
        # trained this long, the fit leaves its budget at the defaults whatever --contexts
        model = make_model(Path(tmp.name) / "model", "llama", dtype="bfloat16",
                           max_positions=max(2 * max(contexts), 1 << 17), **dims)
    runs = [(f"ktlong-{m}", c) for m in modes for c in chunk_sizes]
    runs += [("transformers", 0)] if transformers else []
    runs += [(p, chunk_sizes[0]) for p in peers]  # sampled on ktlong's (first) chunks
    rows = []
    for n in contexts:
        for runtime, chunk in runs:
            args = [sys.executable, "-m", "ktlong.bench.prefill", runtime, str(model), str(n),
                    str(threads), str(chunk), str(sample if runtime != "transformers" else 0)]
            out = subprocess.run(args, capture_output=True, text=True,
                                 env=peer_env() if runtime in PEERS else None)
            if out.returncode != 0:
                lines = out.stderr.strip().splitlines() or ["(no output)"]
                raise RuntimeError(f"{runtime} at {n}: {lines[-1]}")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    out = subprocess.run([sys.executable, "-m", "ktlong.bench.prefill", "peaks", str(threads)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"peak micro-benchmark: {(out.stderr.strip().splitlines() or [''])[-1]}")
    peak = json.loads(out.stdout.strip().splitlines()[-1])
    for r in rows:
        if r["runtime"].startswith("ktlong"):
            against_limit(r, peak)
    for r in rows:  # speed against the dense prefill of the same context and chunk
        base = [b for b in rows if b["context"] == r["context"] and b["runtime"] == "ktlong-dense"
                and b["chunk_size"] == r["chunk_size"]]
        r["vs_dense"] = r["prefill_tok_s"] / base[0]["prefill_tok_s"] if base else None
        if r["runtime"].startswith("ktlong"):  # speed over each peer's at the same context
            r["vs_peers"] = {b["runtime"]: r["prefill_tok_s"] / b["prefill_tok_s"] for b in rows
                             if b["runtime"] in PEERS and b["context"] == r["context"]}
    label = f"model {model}" if tmp is None else f"random Llama {dims}"
    data = {"bench": "prefill", "command": command, "machine": plotting.machine(),
            "threads": threads, "model": dims if tmp is not None else str(model),
            "sampled_chunks": sample, "peak_ops_s": peak, "rows": rows}
    if plot_file is not None:
        plot(data, plot_file)
    if as_json:
        print(json.dumps(data))
        return
    title = f"prefill, {threads} threads, {label}" + (
        f"; {sample} sampled chunks per context" if sample else "")
    table = Table(title=title, caption="peak of the dot-product instructions, "
                  f"{threads} threads: " + ", ".join(f"{k} {v / 1e9:,.0f} GOP/s"
                                                     for k, v in peak.items()))
    for col in ("context", "runtime", "tok/s", "seconds", "attention s", "index s",
                "keys read (lone)", "x dense", "matmul", "linear GOP/s", "of limit", "128K s",
                "peak RSS (GB)"):
        table.add_column(col, justify="right")
    for r in rows:
        ops = r.get("linear_ops_s")
        table.add_row(
            f"{r['context']:,}",
            r["runtime"] + (f" (chunk {r['chunk_size']})" if len(chunk_sizes) > 1
                            and r["chunk_size"] else ""),
            f"{r['prefill_tok_s']:.0f}",
            f"{r['prefill_s']:.1f}",
            "" if r["attention_s"] is None else f"{r['attention_s']:.1f}",
            f"{r['index_s']:.1f}" if r["index_s"] else "",
            "" if r.get("keys_read") is None else
            f"{r['keys_read']:.1%} ({r['lone_read']:.1%})",
            "" if r["vs_dense"] is None else f"{r['vs_dense']:.2f}",
            r.get("matmul", ""),
            "" if ops is None else f"{ops / 1e9:,.0f}",
            "" if r.get("of_limit") is None else f"{r['of_limit']:.0%} of {r['limit']}",
            "" if r.get("projected_128k_s") is None else f"{r['projected_128k_s']:,.0f}",
            f"{r['peak_rss_bytes'] / 1e9:.2f}",
        )
    console = Console(width=max(Console().width, 110))
    console.print(table)
    for r in rows:
        for peer, x in r.get("vs_peers", {}).items():
            console.print(f"{r['context']:,} tokens: {r['runtime']} reads at {x:.2f}x {peer}")


def plot(data: dict[str, Any], path: Path | str) -> Any:
    """Prefill tok/s against context, one line per prefill mode (and chunk size when several
    were compared); transformers dashed. Returns the figure."""
    from ktlong.bench import plot as plotting

    rows = data["rows"]
    several = len({r["chunk_size"] for r in rows if r["runtime"] != "transformers"}) > 1
    by: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        name = r["runtime"]
        if name.startswith("ktlong-"):
            name = f"ktlong {name[7:]}" + (f" (chunk {r['chunk_size']})" if several else "")
        by.setdefault(name, []).append((r["context"], r["prefill_tok_s"]))
    fig, axes = plotting.figure()
    ax = axes[0][0]
    for name, pts in by.items():
        xs, ys = zip(*sorted(pts), strict=True)
        ax.plot(xs, ys, "o-" if name.startswith("ktlong") else "s--", label=name)
    plotting.context_axis(ax, [r["context"] for r in rows])
    ax.set_ylabel("prefill tok/s")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    sampled = data.get("sampled_chunks")
    title = "prefill speed per mode against context" + (
        f" ({sampled} sampled chunks per context)" if sampled else "")
    return plotting.finish(fig, path, title, data)


if __name__ == "__main__":  # a worker: python -m ktlong.bench.prefill RUNTIME MODEL N THREADS
    if sys.argv[1] == "peaks":  # CHUNK SAMPLE, or: python -m ktlong.bench.prefill peaks THREADS
        print(json.dumps(peaks(int(sys.argv[2]))))
    else:
        print(json.dumps(_worker(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7]))))
