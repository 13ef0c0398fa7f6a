"""`ktlong bench e2e`: end-to-end prefill and decode against transformers and llama.cpp.

The model is one of:
- by default, a random 1B-width Llama (BENCH_SHAPE) written by the project's own code as an HF
  folder (BF16 weights; the tokenizer trained here) and, for llama.cpp, as a GGUF F16 file of the
  same values: ktlong keeps the BF16 weights, transformers widens them to float32;
- `--shape 8b --layers N --weights q4_k_m|q8_0|q6_k|f16`: a random model at Llama-3.1-8B's widths
  as one GGUF file (ktlong.bench.genmodel), which ktlong and llama.cpp both read;
- `--model PATH`: the user's own GGUF file (ktlong and llama.cpp read it) or HF folder (ktlong and
  transformers).
The prompt is tokenized once and the same ids are fed to every runtime. Each measurement runs in a
fresh subprocess (so its peak RSS is its own); runtimes are interleaved per context and per repeat
(in reverse order every other repeat); medians are reported, and for each ktlong runtime, per
repeat, its median decode run over llama.cpp's best run in that repeat
(`vs_llamacpp_best_beside`). Memory is the worker's peak RSS over its baseline: its RSS after the
runtime has run once on a tiny model of the same dtypes (TINY_SHAPE), so code, compiled kernels
and thread pools are the baseline's, for every runtime alike.

Timing, the same for every runtime: prefill is the time to the first sampled token (one forward of
the prompt); decode speed is the one-token forwards (and greedy sampling) between that token and
the last over the time between them, with EOS treated as an ordinary token (nobody stops early).
Decode is run `decode_runs` times from the same prompt (the prompt's last token re-fed over the
kept KV of the rest, the same for every runtime) and the median is reported: one window of a
second or two moves by a third on a shared machine, and a long prefill cannot be repeated cheaply.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ktlong.bench import peer_env
from ktlong.bench.rss import peak_rss

# A 1B-class layer (TinyLlama's width, head_dim 128, GQA 16/4): per layer, weights and the KV a
# decode step reads stand in the proportion of real models; two layers so 64K prefills in minutes.
BENCH_SHAPE = dict(layers=2, hidden=2048, heads=16, kv_heads=4, head_dim=128, intermediate=5632)
RUNTIMES = ("ktlong-default", "ktlong-dense", "transformers", "llamacpp", "llamacpp-fa",
            "llamacpp-q8kv", "llamacpp-nofa")
LLAMACPP_KV = {"llamacpp-fa": (True, 1), "llamacpp-q8kv": (True, 8), "llamacpp-nofa": (False, 1)}
# flash attention, KV type (ggml: 1 = F16, 8 = Q8_0) of each llama.cpp runtime
DECODE_RUNS = 3  # decode runs per prefill; the median is reported
# the warm-up model: BENCH_SHAPE's dtypes and head_dim, so it runs the same compiled kernels
TINY_SHAPE = dict(layers=1, hidden=256, heads=4, kv_heads=1, head_dim=128, intermediate=512)
WARM_TOKENS = 512
PEERS_HINT = "pip install 'ktlong[peers]' (llama-cpp-python builds from source)"


def _llamacpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except Exception:
        return False
    return True




# --- workers (one runtime, one context, in a fresh process) -----------------------------------
def _window(stamps: list[float], last_fed: bool = True) -> list[float]:
    """[forwards, seconds] of one decode run, from its first sampled token to its last: a
    llama.cpp or transformers token is fed through the model on the way to the next one; ktlong
    feeds each token before yielding it, but not the last (`last_fed` False)."""
    return [len(stamps) - (1 if last_fed else 2), stamps[-1] - stamps[0]]


def _run_ktlong(profile: str, model: str, ids: list[int], new: int, threads: int,
                runs: int, kv_type: str = "BF16", kv_tier: str = "ram") -> dict:
    import dataclasses

    from ktlong.config import resolve_settings
    from ktlong.engine import Sampling, Session
    from ktlong.model import load_model
    from ktlong.warmup import work_clock

    lm = load_model(model, device="CPU")  # float32 activations, the checkpoint's own weights
    lm = dataclasses.replace(lm, eos_ids=())  # EOS is an ordinary token: always decode `new`
    st = resolve_settings(  # built-in defaults + the profile: config.yaml edits do not count
        profile, {"max_seq_len": len(ids) + new + 16, "threads_num": threads,
                  "kv_type": kv_type, "kv_tier": kv_tier.upper()}, config_file=False
    ).settings
    weights = lm.spec.weights_bytes  # what the loader holds (a GGUF: the mapped file's tensors)
    session = Session(lm, st)  # compiles (or loads) its kernels here, before any timing
    t0 = work_clock()  # perf_counter less compile time: a kernel compiling is no work
    session.prefill(ids)
    windows, share = [], 1.0
    for r in range(runs):
        if r:  # the prompt again: its last token re-fed over the kept KV of the rest
            session.truncate(len(ids) - 1)
            session.prefill(ids[-1:])
        out, stamps = [], []
        for step in session.generate(Sampling(max_new_tokens=new)):
            stamps.append(work_clock())
            out.append(step.token_id)
            share = step.stats.attended_share
        windows.append(_window(stamps, last_fed=False))
        if r == 0:
            first = (stamps[0], out, session.store.nbytes_used())
    return dict(
        t0=t0, first=first[0], out=first[1], windows=windows, weights_bytes=weights,
        kv_bytes=first[2], attended_share=share, threads=session.threads,
        weight_type=lm.weight_type, kv_type=kv_type, kv_tier=kv_tier,
    )


def _run_transformers(model: str, ids: list[int], new: int, threads: int, runs: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache, LogitsProcessor

    torch.set_num_threads(threads)
    stock = AutoModelForCausalLM.from_pretrained(
        model, attn_implementation="sdpa", dtype=torch.float32
    ).eval()
    stock.generation_config.eos_token_id = None  # EOS is an ordinary token
    weights = sum(p.numel() * p.element_size() for p in stock.parameters())
    stamps: list[float] = []

    class Stamp(LogitsProcessor):  # called once per new token, right after its forward
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            stamps.append(time.perf_counter())
            return scores

    cache = DynamicCache()
    windows = []
    t0 = time.perf_counter()
    for r in range(runs):
        if r:  # the prompt again: generate feeds only the tokens the cache lacks (the last)
            cache.crop(len(ids) - 1 - cache.get_seq_length())  # < 0: drop that many
            stamps.clear()
        with torch.inference_mode():
            seq = stock.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                pad_token_id=0, past_key_values=cache, logits_processor=[Stamp()],
            )
        windows.append(_window(stamps))
        if r == 0:
            first = (stamps[0], seq[0, len(ids):].tolist())
    cfg = stock.config
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * (len(ids) + new)
    return dict(
        t0=t0, first=first[0], out=first[1], windows=windows, weights_bytes=weights, kv_bytes=kv,
    )


def _run_llamacpp(gguf: str, ids: list[int], new: int, threads: int, runtime: str,
                  runs: int) -> dict:
    import llama_cpp

    from ktlong.spec import read_spec

    flash, kv_type = LLAMACPP_KV[runtime]
    llm = llama_cpp.Llama(
        model_path=gguf, n_ctx=len(ids) + new + 16, n_batch=512, n_threads=threads,
        n_threads_batch=threads, flash_attn=flash, type_k=kv_type, type_v=kv_type,
        n_gpu_layers=0, verbose=False,
    )
    windows = []
    t0 = time.perf_counter()
    for r in range(runs):  # a repeat keeps the prompt's KV but its last token (prefix match)
        stamps: list[float] = []
        out: list[int] = []
        # generate() never stops by itself (EOS lives in create_completion); greedy via top_k 1
        for tok in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0,
                                reset=True):
            stamps.append(time.perf_counter())
            out.append(int(tok))
            if len(out) == new:
                break
        windows.append(_window(stamps))
        if r == 0:
            first = (stamps[0], out)
    spec = read_spec(gguf)
    per_value = 34 / 32 if kv_type == 8 else 2  # Q8_0: 32 values in 34 bytes
    kv = 2 * spec.n_layers * spec.n_kv_heads * spec.head_dim * per_value * (len(ids) + new)
    return dict(
        t0=t0, first=first[0], out=first[1], windows=windows,
        weights_bytes=spec.weights_bytes, kv_bytes=int(kv),
    )


def _warm(runtime: str, tiny: str, ids: list[int], threads: int, kv_type: str = "BF16",
          kv_tier: str = "ram") -> None:
    """Run the runtime once on the tiny model of the same dtypes (`tiny`: its HF folder, with its
    GGUF beside it; ktlong in the same kv_type and kv_tier): code, compiled kernels, thread pools
    and allocator set-up are then loaded, so they fall in the baseline and not in what the
    benchmark model adds."""
    folder = Path(tiny) if Path(tiny).is_dir() else Path(tiny).with_suffix("")
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    ids = [i % vocab for i in ids[:WARM_TOKENS]]  # the benchmark model's ids, in the tiny's
    if runtime.startswith("ktlong-"):
        import dataclasses

        from ktlong.config import resolve_settings
        from ktlong.engine import Sampling, Session
        from ktlong.model import load_model

        lm = dataclasses.replace(load_model(tiny, device="CPU"), eos_ids=())  # same weight types
        st = resolve_settings(  # a budget smaller than the prompt: the sparse kernels run too
            runtime.split("-", 1)[1], {"max_seq_len": WARM_TOKENS + 16, "threads_num": threads,
                                       "block_size": 16, "init_len": 16, "local_windows_len": 64,
                                       "second_select_num": 12, "kv_type": kv_type,
                                       "kv_tier": kv_tier.upper()}, config_file=False,
        ).settings
        session = Session(lm, st)
        session.prefill(ids)
        list(session.generate(Sampling(max_new_tokens=3)))
    elif runtime == "transformers":
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        stock = AutoModelForCausalLM.from_pretrained(
            tiny, attn_implementation="sdpa", dtype=torch.float32
        ).eval()
        with torch.inference_mode():
            stock.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False,
                           attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           pad_token_id=0)
    else:
        import llama_cpp

        flash, kv_type = LLAMACPP_KV[runtime]
        llm = llama_cpp.Llama(
            model_path=str(Path(tiny).with_suffix(".gguf")), n_ctx=WARM_TOKENS + 16,
            n_threads=threads, n_threads_batch=threads, flash_attn=flash, type_k=kv_type,
            type_v=kv_type, n_gpu_layers=0, verbose=False,
        )
        for i, _ in enumerate(llm.generate(ids, top_k=1, temp=0.0, reset=True)):
            if i == 2:
                break
    gc.collect()


def _worker(runtime: str, model: str, gguf: str, ids_file: str, new: int, threads: int,
            runs: int, tiny: str, kv_type: str = "BF16", kv_tier: str = "ram") -> dict:
    ids = json.loads(Path(ids_file).read_text())
    # the process's own footprint before the benchmark model: interpreter, libraries, and the
    # runtime run once on a tiny model, so peak RSS - baseline is what this model and context add
    # (a GGUF model's warm-up is the tiny model's GGUF, in the same weight types)
    _warm(runtime, str(Path(tiny).with_suffix(".gguf")) if runtime.startswith("ktlong-")
          and model.endswith(".gguf") else tiny, ids, threads, kv_type, kv_tier)
    baseline = peak_rss(reset=True)
    if runtime.startswith("ktlong-"):
        r = _run_ktlong(runtime.split("-", 1)[1], model, ids, new, threads, runs, kv_type,
                        kv_tier)
    elif runtime == "transformers":
        r = _run_transformers(model, ids, new, threads, runs)
    elif runtime.startswith("llamacpp"):
        r = _run_llamacpp(gguf, ids, new, threads, runtime, runs)
    else:
        raise ValueError(f"unknown runtime {runtime}")
    n = len(ids)
    prefill_s = r.pop("first") - r.pop("t0")
    rates = [k / s if s > 0 else 0.0 for k, s in r["windows"]]
    return dict(
        runtime=runtime, context=n, status="ok", new_tokens=len(r["out"]),
        prefill_s=prefill_s, prefill_tok_s=n / prefill_s,
        decode_s=statistics.median(s for _, s in r["windows"]),
        decode_tok_s=statistics.median(rates), decode_tok_s_runs=rates,
        peak_rss_bytes=peak_rss(), baseline_rss_bytes=baseline, **r,
    )


# --- driver ------------------------------------------------------------------------------------
def _expand(runtimes: list[str], have_llamacpp: bool) -> list[str]:
    out = []
    for r in runtimes:
        if r not in RUNTIMES:
            from ktlong.errors import KtlongError

            raise KtlongError(f"--runtimes: unknown runtime {r!r}", hint=f"choose from {RUNTIMES}")
        if r.startswith("llamacpp"):
            out += ([r] if "-" in r else ["llamacpp-fa", "llamacpp-q8kv"]) if have_llamacpp else []
        else:
            out.append(r)
    return out


def _median_row(rows: list[dict]) -> dict:
    if len(rows) == 1:
        return rows[0]
    out = dict(rows[0])
    for key in ("prefill_s", "prefill_tok_s", "decode_s", "decode_tok_s", "peak_rss_bytes",
                "baseline_rss_bytes"):
        out[key] = statistics.median(r[key] for r in rows)
    out["repeats"] = len(rows)
    out["decode_tok_s_runs"] = [x for r in rows for x in r["decode_tok_s_runs"]]  # every repeat's
    out["windows"] = [w for r in rows for w in r["windows"]]
    return out


def _beside_best(raw: dict[tuple[str, int], list[dict]], names: list[str], name: str,
                 n: int) -> list[float]:
    """A ktlong runtime's median decode run over the best decode run of any llama.cpp runtime in
    the same repeat (the runs beside it in time), per repeat: on a machine whose bandwidth swings
    from minute to minute, each ratio compares runs from the same minutes."""
    peers = [p for p in names if p.startswith("llamacpp")]
    if not name.startswith("ktlong") or not peers:
        return []
    out = []
    for rep, row in enumerate(raw[(name, n)]):
        best = [max(raw[(p, n)][rep]["decode_tok_s_runs"]) for p in peers
                if raw[(p, n)][rep]["status"] == "ok"]
        if row["status"] == "ok" and best:
            out.append(statistics.median(row["decode_tok_s_runs"]) / max(best))
    return out


def _parse(proc: subprocess.CompletedProcess, name: str, n: int) -> dict:
    """A worker's JSON row, or a `failed` row saying why (one runtime's failure, an OOM kill
    say, must not lose the others' rows)."""
    if proc.returncode == 0:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    if proc.returncode < 0:
        why = f"killed by signal {-proc.returncode}" + (" (out of memory?)"
                                                         if proc.returncode == -9 else "")
    else:
        why = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    return dict(runtime=name, context=n, status="failed", note=why)


def _prepare(root: Path, contexts: list[int], new_tokens: int, shape: dict[str, int],
             model: str | None, gen: tuple[str, int, str] | None, need_gguf: bool,
             log: Any) -> dict[str, Any]:
    """The files the workers read: {model (what ktlong loads), gguf (what llama.cpp loads),
    tiny (warm-up HF folder, its GGUF beside it), tokenizer (a model folder or GGUF),
    describe, origin}."""
    from ktlong.tinymodel import make_model, write_gguf

    tiny_shape = dict(TINY_SHAPE)
    if gen is not None:
        from ktlong.bench import genmodel
        from ktlong.config import ktlong_home

        name, layers, weights = gen
        path, origin = genmodel.build(ktlong_home() / "bench-models", name, layers, weights, log)
        tiny = make_model(root / "tiny", "llama", dtype="bfloat16", **tiny_shape)
        write_gguf(tiny, tiny.with_suffix(".gguf"), genmodel.tensor_type(
            "blk.0.ffn_up.weight", weights, 1))  # the warm-up reads the same kernels
        return dict(model=str(path), gguf=str(path), tiny=str(tiny), tokenizer=str(tiny),
                    describe=f"random {name} widths, {layers} layers, {weights}",
                    origin=f"{origin}; {path} ({path.stat().st_size / 1e9:.2f} GB)")
    if model is not None:
        from ktlong.spec import read_spec

        spec = read_spec(model)
        # the warm-up model: the same family where the tiny writer knows it, else a Llama
        tiny = make_model(root / "tiny", spec.arch if spec.arch in ("qwen2", "qwen3") else "llama",
                          dtype="bfloat16", **tiny_shape)
        if spec.format == "gguf":
            top = max(spec.weight_types, key=lambda t: spec.weight_types[t])
            write_gguf(tiny, tiny.with_suffix(".gguf"), top if top in (
                "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16", "F32")
                else "Q8_0")
        return dict(model=spec.path, gguf=spec.path if spec.format == "gguf" else "",
                    tiny=str(tiny), tokenizer=spec.path, describe=f"{spec.path} ({spec.arch})",
                    origin="", prose=True)
    hf = make_model(
        root / "hf", "llama", max_positions=2 * (max(contexts) + new_tokens + 16),
        dtype="bfloat16", **shape
    )
    tiny = make_model(root / "tiny", "llama", dtype="bfloat16", **tiny_shape)  # see _warm
    gguf = root / "model-f16.gguf"
    if need_gguf:
        write_gguf(hf, gguf, "F16")
        write_gguf(tiny, tiny.with_suffix(".gguf"), "F16")
    return dict(model=str(hf), gguf=str(gguf), tiny=str(tiny), tokenizer=str(hf),
                describe=f"random Llama {shape}", origin="")


def _prompt_ids(tokenizer: str, n: int, prose: bool = False) -> list[int]:
    """`n` prompt ids: real prose for a real model (ktlong.bench.prose), else filler words.
    A GGUF's tokenizer is converted here, once: the workers' loads then read the saved one."""
    from ktlong.model import load_tokenizer
    from ktlong.tinymodel import filler_text

    tok = load_tokenizer(tokenizer)
    if prose:
        from ktlong.bench import prose as real

        return real.ids(tok, n)
    words = n
    while len(ids := tok(filler_text(words, seed=0))["input_ids"]) < n:
        words *= 2
    return ids[:n]


def run(contexts: list[int], new_tokens: int, threads: int, runtimes: list[str],
        repeats: int = 1, shape: dict[str, int] | None = None,
        log: Any = None, decode_runs: int = DECODE_RUNS, model: str | None = None,
        gen: tuple[str, int, str] | None = None, kv_type: str = "BF16",
        kv_tier: str = "ram") -> dict[str, Any]:
    """Measure every runtime at every context (ktlong's KV in kv_type, in the kv_tier "ram" or
    "disk"; llama.cpp's runtimes name their own KV type); returns {threads, model, rows, ...}."""
    shape = dict(shape or BENCH_SHAPE)
    # 0: ktlong picks the idle cores itself (its default); the peers get every core
    peer_threads = threads or os.cpu_count() or 1
    is_gguf = gen is not None
    if model is not None:
        from ktlong.spec import read_spec

        is_gguf = read_spec(model).format == "gguf"
    if is_gguf:  # transformers would widen the file; llama.cpp reads it as it is
        runtimes = [r for r in runtimes if r != "transformers"]
    elif model is not None:  # an HF folder: llama.cpp needs a GGUF of it
        runtimes = [r for r in runtimes if not r.startswith("llamacpp")]
    wants_llamacpp = any(r.startswith("llamacpp") for r in runtimes)
    have_llamacpp = wants_llamacpp and _llamacpp_available()
    names = _expand(runtimes, have_llamacpp)
    tmp = tempfile.TemporaryDirectory(prefix="ktlong-e2e-")
    root = Path(tmp.name)
    files = _prepare(root, contexts, new_tokens, shape, model, gen, have_llamacpp, log)
    ids_files = {}
    for n in contexts:  # tokenize once; every runtime is fed these ids
        ids = _prompt_ids(files["tokenizer"], n, files.get("prose", False))
        ids_files[n] = root / f"ids-{n}.json"
        ids_files[n].write_text(json.dumps(ids))
    argv = [files["model"], files["gguf"] or "-"]
    if any(name.startswith("ktlong") for name in names):  # compile kernels: measure cached runs
        warm_ids = root / "ids-warm.json"  # a short prompt: the fill must not prefill 128K
        warm_ids.write_text(json.dumps(ids[:1024]))  # the last tokenized prompt's start
        subprocess.run([sys.executable, "-m", "ktlong.bench.e2e", "ktlong-default", *argv,
                        str(warm_ids), "4", str(threads), "1", files["tiny"], kv_type, kv_tier],
                       capture_output=True, check=False)
    raw: dict[tuple[str, int], list[dict]] = {}
    for rep in range(repeats):
        for n in contexts:
            for name in names[::-1] if rep % 2 else names:  # no runtime always first or last
                if log:
                    log(f"{name} at {n:,} tokens")
                proc = subprocess.run(
                    [sys.executable, "-m", "ktlong.bench.e2e", name, *argv,
                     str(ids_files[n]), str(new_tokens),
                     str(threads if name.startswith("ktlong") else peer_threads), str(decode_runs),
                     files["tiny"], kv_type, kv_tier],
                    capture_output=True, text=True,
                    env=None if name.startswith("ktlong") else peer_env(),  # peers: the user's
                )
                row = _parse(proc, name, n)
                if log:
                    log(json.dumps({k: v for k, v in row.items() if k != "out"}))
                raw.setdefault((name, n), []).append(row)
    rows = []
    for n in contexts:
        ref_name = "transformers" if ("transformers", n) in raw else "llamacpp-fa"
        ref = raw.get((ref_name, n), [{}])[0].get("out")
        for name in names:
            ok = [r for r in raw[(name, n)] if r["status"] == "ok"]
            row = _median_row(ok) if ok else raw[(name, n)][0]
            if ref is not None and ok and name != ref_name:
                same = 0
                for a, b in zip(row["out"], ref, strict=False):
                    if a != b:
                        break
                    same += 1
                row[f"same_ids_as_{ref_name.split('-')[0]}"] = same
            paired = _beside_best(raw, names, name, n)
            if paired:
                row["vs_llamacpp_best_beside"] = paired
            rows.append(row)
        if wants_llamacpp and not have_llamacpp:
            rows.append(dict(runtime="llamacpp", context=n, status="not installed",
                             note=PEERS_HINT))
    tmp.cleanup()
    return {"threads": threads or f"{peer_threads} (ktlong: idle cores)",
            "new_tokens": new_tokens, "decode_runs": decode_runs, "kv_type": kv_type,
            "kv_tier": kv_tier,
            "model": shape if gen is None and model is None else files["describe"],
            "origin": files["origin"], "rows": rows}


def main(contexts: list[int], new_tokens: int = 64, threads: int = 0, as_json: bool = False,
         plot_file: Path | None = None, runtimes: list[str] | None = None, repeats: int = 1,
         shape: dict[str, int] | None = None, command: str = "",
         decode_runs: int = DECODE_RUNS, model: str | None = None,
         gen: tuple[str, int, str] | None = None, kv_type: str = "BF16",
         kv_tier: str = "ram") -> None:
    from rich.console import Console

    from ktlong.bench import plot as plotting

    console = Console(stderr=True)
    if plot_file is not None:
        plotting.require()
    log = console.log  # progress on stderr, also under --json
    data = run(sorted(contexts), new_tokens, threads, list(runtimes or RUNTIMES[:4]), repeats,
               shape, log, decode_runs, model, gen, kv_type, kv_tier)
    data = {"bench": "e2e", "command": command, "machine": plotting.machine(), **data}
    if plot_file is not None:
        plot(data, plot_file)
    if as_json:
        print(json.dumps(data))
        return
    print_table(data)


def print_table(data: dict[str, Any]) -> None:
    """The terminal table of `run`'s result (also for a saved --json output)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    model = data["model"]
    kv = f", ktlong's KV {data['kv_type']} in {data['kv_tier']}" if "kv_type" in data else ""
    table = Table(title=f"end to end, {data['threads']} threads, {data['new_tokens']} new tokens, "
                        + (f"random Llama {model}" if isinstance(model, dict) else model) + kv)
    for col in ("context", "runtime", "prefill tok/s", "decode tok/s", "peak RSS (GB)",
                "RSS - baseline (GB)", "weights+KV (GB)", "blocks read", "same ids"):
        table.add_column(col, justify="right")
    for r in data["rows"]:
        if r["status"] != "ok":
            table.add_row(f"{r['context']:,}", r["runtime"], r["status"], *[""] * 5,
                          r.get("note", ""))
            continue
        wk = r["weights_bytes"] + (r["kv_bytes"] or 0)
        share = r.get("attended_share")
        same = r.get("same_ids_as_transformers", r.get("same_ids_as_llamacpp"))
        table.add_row(
            f"{r['context']:,}", r["runtime"], f"{r['prefill_tok_s']:.0f}",
            f"{r['decode_tok_s']:.1f}", f"{r['peak_rss_bytes'] / 1e9:.2f}",
            f"{(r['peak_rss_bytes'] - r['baseline_rss_bytes']) / 1e9:.2f}", f"{wk / 1e9:.2f}",
            "" if share is None else f"{share:.0%}",
            "ref" if r["runtime"] in ("transformers", "llamacpp-fa") and same is None else
            ("" if same is None else f"{same}/{r['new_tokens']}"),
        )
    Console().print(table)
    for r in data["rows"]:
        if r.get("vs_llamacpp_best_beside"):
            x = r["vs_llamacpp_best_beside"]
            Console().print(
                f"{r['runtime']} at {r['context']:,}: its median decode run over llama.cpp's best "
                f"run beside it, per repeat: {' '.join(f'{v:.2f}x' for v in x)} (median "
                f"{statistics.median(x):.2f}x)", highlight=False)
    if data.get("origin"):
        Console().print(f"model file: {escape(data['origin'])}")
    if any(r["status"] == "not installed" for r in data["rows"]):
        Console().print(f"llama.cpp: `import llama_cpp` failed; {escape(PEERS_HINT)}")


def plot(data: dict[str, Any], path: Path | str) -> Any:
    """Decode tok/s against context, one line per runtime (ktlong's solid, the peers dashed).
    Returns the figure."""
    from ktlong.bench import plot as plotting

    fig, axes = plotting.figure()
    ax = axes[0][0]
    by: dict[str, list[tuple[int, float]]] = {}
    for r in data["rows"]:
        if r["status"] == "ok":
            by.setdefault(r["runtime"], []).append((r["context"], r["decode_tok_s"]))
    for name, pts in by.items():
        xs, ys = zip(*sorted(pts), strict=True)
        ax.plot(xs, ys, "o-" if name.startswith("ktlong") else "s--", label=name)
    plotting.context_axis(ax, [r["context"] for r in data["rows"]])
    ax.set_ylabel("decode tok/s")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    if by:
        ax.legend(fontsize=8)
    return plotting.finish(
        fig, path, f"decode speed against context, {data.get('new_tokens', '?')} new tokens", data)


if __name__ == "__main__":  # a worker; argv: RUNTIME HF GGUF IDS NEW THREADS RUNS TINY KV TIER
    a = sys.argv[1:]
    print(json.dumps(_worker(a[0], a[1], a[2], a[3], int(a[4]), int(a[5]), int(a[6]), a[7],
                             *a[8:10])))
