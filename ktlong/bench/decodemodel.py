"""`ktlong bench decode -m MODEL` / `--shape 8b`: a whole model's decode over a long context.

With a real model (`-m`), by default the context is what a user's chat holds: real prose
(ktlong.bench.prose: the license texts Debian ships, Python's documentation) behind the model's
chat template, read by ktlong's own prefill through the prompt cache (the first run prefills and
stores the entry, later runs map it, as a second chat on the same document does), then a question
(its votes timed as `question_s`) and `steps` tokens, `runs` times from the same point: the chat's
own path, `prose_worker`. `--kv random` (and `--shape`, whose random weights read nothing) fills
the store with random rows instead, a kernel-level figure that names itself "random rows":

No prefill: each KV type's store is filled with random rows (every layer, `context` tokens: at 1M
tokens and 32 layers that is 38 GB of Q4_0, which the disk tier writes to its file), anchors are
built from them by the same kernel a prefill uses, and the model then decodes over that store
with each profile: a 32-token question is prefilled after the context (its votes, for a profile
with question_blocks, are timed as `question_s`), then `steps` tokens, `runs` times from the same
point. Decode speed counts the one-token forwards between the first sampled token and the last.
With `peers`, llama.cpp (llama-cpp-python) decodes over the same file and context the same way:
its KV cache is a synthetic state of random rows (ktlong.bench.llamastate) loaded with
`llama_state_seq_set_data`, in F16 or Q8_0, with flash attention on or off (llama.cpp reads every
token each step, so the values do not change its speed).
Weights are the random GGUF of `ktlong bench e2e --shape` (ktlong.bench.genmodel). Each KV type
runs in a fresh process, so its memory figures are its own: RssAnon (anonymous memory: what the
file mappings, weights and a disk-tier KV, leave out) and RssFile after the decode, and the bytes
the process read from the disk per decoded token while decoding (/proc/self/io read_bytes:
page-cache misses; the question's reads are left out).
The random values make attention nearly uniform: the blocks chosen each step are as scattered as
they can be, so the disk tier's page cache helps little.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ktlong.bench import peer_env

FILL_TOKENS = 16384  # tokens per layer filled at a time
QUESTION = 32  # tokens of the question prefilled before each decode run
PEERS = ("llamacpp-fa", "llamacpp-q8kv", "llamacpp-nofa")  # llama.cpp: flash attention with
# F16 or Q8_0 KV, or without it (F16 KV)


def _proc_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _read_bytes() -> int:
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _rows(store: Any, n: int, seed: int) -> Any:
    """n random rows [Hkv, n, row] in the store's format (a 16-bit or quantised one)."""
    import numpy as np

    from ktlong.bench.decode import random_rows

    s = store.shape
    raw = np.empty((s.n_kv_heads, n, store.row * store.k_tail[0].itemsize), np.uint8)
    return random_rows(raw, store.kv_kind, s.head_dim, seed).view(store.k_tail[0].dtype)


def worker(model: str, kv_type: str, tier: str, context: int, steps: int, runs: int,
           threads: int, cache_dir: str, profile: str = "default") -> dict[str, Any]:
    import dataclasses

    import numpy as np

    from ktlong.config import resolve_settings
    from ktlong.engine import Sampling, Session
    from ktlong.fit import fit_to_model
    from ktlong.model import load_model
    from ktlong.warmup import work_clock

    lm = dataclasses.replace(load_model(model, device="CPU"), eos_ids=())
    st = fit_to_model(resolve_settings(profile, {  # a real model's budget: its trained length
        "max_seq_len": context + QUESTION + steps + 64, "threads_num": threads, "kv_type": kv_type,
        "kv_tier": tier.upper(), "cache_dir": cache_dir}, config_file=False), lm.spec).settings
    session = Session(lm, st)  # compiles (or loads) its kernels here
    store = session.store
    t0 = time.perf_counter()
    for layer in range(store.shape.n_layers):
        for c0 in range(0, context, FILL_TOKENS):
            n = min(FILL_TOKENS, context - c0)
            seed = 2 * (layer * (context // FILL_TOKENS + 1) + c0 // FILL_TOKENS)
            store.write_rows(layer, _rows(store, n, seed), _rows(store, n, seed + 1))
    ring = session.window  # sliding-window layers (Gemma 3): their last `window` rows
    if ring is not None:
        shape = (len(ring.layers), 2, ring.n_kv_heads, ring.window, ring.head_dim)
        ring.load(np.random.default_rng(7).standard_normal(shape, np.float32), context)
        ring.pin(context)  # each run starts over from here
    fill_s = time.perf_counter() - t0
    session.tokens = [0] * context
    t0 = time.perf_counter()
    session.policy.complete_anchors()
    anchors_s = time.perf_counter() - t0
    windows, question_s, read, decoded = [], [], 0, 0
    for _ in range(runs):
        session.truncate(context)
        t0 = work_clock()
        session.prefill(list(range(1, QUESTION + 1)))  # the question, over the synthetic context
        question_s.append(work_clock() - t0)
        pinned = int(session.policy.pinned().size)
        io0, stamps = _read_bytes(), [work_clock()]
        for _step in session.generate(Sampling(max_new_tokens=steps)):
            stamps.append(work_clock())
        read += _read_bytes() - io0  # the decode's reads, not the question's
        # a step feeds its token through the model before it is yielded, but the last one
        windows.append([len(stamps) - 2, stamps[-1] - stamps[0]])
        decoded += len(stamps) - 2
    rates = sorted(n / s for n, s in windows)
    return {"profile": profile, "kv_type": kv_type, "kv_tier": tier, "kv_source": "random",
            "context": context,
            "layers": lm.spec.n_layers, "question_s": sorted(question_s)[len(question_s) // 2],
            "pinned": pinned,
            "tok_s": rates[len(rates) // 2], "runs_tok_s": rates, "fill_s": fill_s,
            "anchors_s": anchors_s, "kv_bytes": store.nbytes_used(),
            "disk_read_per_token": read / max(decoded, 1),
            "rss_anon_gb": _proc_kb("RssAnon") / 1e6, "rss_file_gb": _proc_kb("RssFile") / 1e6,
            "threads": session.threads}


QUESTION_TEXT = "Write a long summary of this document."  # the prose runs' question


def prose_worker(model: str, kv_type: str, context: int, steps: int, runs: int, threads: int,
                 cache_dir: str, profile: str = "default", document: str = "") -> dict[str, Any]:
    """A chat's decode: `context` tokens of real prose (or the whole `document` file, read as
    the chat reads it) as the chat reads a document (template, prefill or prompt cache), a
    question, then `steps` tokens, `runs` times."""
    import dataclasses

    from ktlong.config import resolve_settings
    from ktlong.engine import Sampling
    from ktlong.fit import fit_to_model
    from ktlong.model import load_model
    from ktlong.promptcache import open_document
    from ktlong.warmup import warm_up, work_clock

    lm = dataclasses.replace(load_model(model, device="CPU"), eos_ids=())
    ids, q_ids = _chat_ids(lm.tokenizer, context, document)
    st = fit_to_model(resolve_settings(profile, {  # as the chat fits them to the model
        "threads_num": threads, "kv_type": kv_type, "cache_dir": cache_dir},
        config_file=False), lm.spec).settings
    warm_up(lm, st, n_tokens=len(q_ids) + steps)  # compiled before anything is timed
    t0 = work_clock()
    opened = open_document(lm, st, ids, cache_dir=Path(cache_dir) if cache_dir else None)
    open_s = work_clock() - t0
    session = opened.session
    windows, question_s, read, decoded = [], [], 0, 0
    for _ in range(runs):
        session.truncate(len(ids))
        t0 = work_clock()
        session.extend_to(q_ids)
        question_s.append(work_clock() - t0)
        pinned = int(session.policy.pinned().size)
        io0, stamps = _read_bytes(), [work_clock()]
        for _step in session.generate(Sampling(max_new_tokens=steps)):
            stamps.append(work_clock())
        read += _read_bytes() - io0
        windows.append([len(stamps) - 2, stamps[-1] - stamps[0]])
        decoded += len(stamps) - 2
    rates = sorted(n / s for n, s in windows)
    return {"profile": profile, "kv_type": kv_type, "kv_tier": "ram", "kv_source": "prose",
            "context": len(ids), "layers": lm.spec.n_layers, "opened_from": opened.source,
            "open_s": open_s, "question_s": sorted(question_s)[len(question_s) // 2],
            "pinned": pinned, "tok_s": rates[len(rates) // 2], "runs_tok_s": rates,
            "fill_s": open_s, "anchors_s": 0.0, "kv_bytes": session.store.nbytes_used(),
            "attended_share": session.policy.attended_share(),
            "step_tokens": session.policy.budget_blocks() * st.block_size,
            "disk_read_per_token": read / max(decoded, 1),
            "rss_anon_gb": _proc_kb("RssAnon") / 1e6, "rss_file_gb": _proc_kb("RssFile") / 1e6,
            "threads": session.threads}


def llamacpp_worker(model: str, runtime: str, context: int, steps: int, runs: int,
                    threads: int) -> dict[str, Any]:
    """llama.cpp's decode over a synthetic KV of `context` tokens, measured as `worker` does."""
    import llama_cpp

    from ktlong.bench import llamastate
    from ktlong.bench.e2e import LLAMACPP_KV
    from ktlong.spec import read_spec

    flash, ggml_type = LLAMACPP_KV[runtime]
    spec = read_spec(model)
    threads = threads or os.cpu_count() or 1
    llm = llama_cpp.Llama(
        model_path=model, n_ctx=context + QUESTION + steps + 64, n_batch=512,
        n_threads=threads, n_threads_batch=threads, flash_attn=flash,
        type_k=ggml_type, type_v=ggml_type, n_gpu_layers=0, verbose=False)
    t0 = time.perf_counter()
    llamastate.load(llm, spec, context, flash, ggml_type)
    kv_dim = spec.n_kv_heads * spec.head_dim
    kv_bytes = 2 * spec.n_layers * context * llamastate.row_bytes(ggml_type, kv_dim)  # all of it
    fill_s = time.perf_counter() - t0
    prefix = [1] * context  # what llama-cpp-python believes its cache holds: a prefix match
    llm.input_ids[:context] = prefix
    llm.n_tokens = context
    row = _llamacpp_runs(llm, prefix, list(range(2, QUESTION + 2)), steps, runs)
    return {"profile": runtime, "kv_type": "Q8_0" if ggml_type == 8 else "F16",
            "kv_tier": "ram", "kv_source": "random", "context": context,
            "layers": spec.n_layers, **row, "fill_s": fill_s, "kv_bytes": kv_bytes,
            "threads": threads}


def _llamacpp_runs(llm: Any, prefix: list[int], question: list[int], steps: int,
                   runs: int) -> dict[str, Any]:
    """`runs` times over the cached `prefix`: the question read again, then `steps` greedy
    tokens; the median decode speed, measured as `worker` measures ktlong's."""
    windows, question_s, read, decoded = [], [], 0, 0
    n = len(prefix)
    for _ in range(runs):
        stamps, t0 = [], time.perf_counter()
        llm.input_ids[n:n + len(question)] = -1  # no match past the prefix: re-read it
        for _tok in llm.generate(prefix + question, top_k=1, top_p=1.0, temp=0.0,
                                repeat_penalty=1.0, reset=True):
            stamps.append(time.perf_counter())  # sampled; its forward comes with the next one
            if len(stamps) == 1:
                io0 = _read_bytes()
            if len(stamps) == steps:
                break
        read += _read_bytes() - io0
        question_s.append(stamps[0] - t0)
        windows.append([len(stamps) - 1, stamps[-1] - stamps[0]])
        decoded += len(stamps) - 1
    rates = sorted(k / s for k, s in windows)
    return {"question_s": sorted(question_s)[len(question_s) // 2], "pinned": 0,
            "tok_s": rates[len(rates) // 2], "runs_tok_s": rates, "anchors_s": 0.0,
            "disk_read_per_token": read / max(decoded, 1),
            "rss_anon_gb": _proc_kb("RssAnon") / 1e6, "rss_file_gb": _proc_kb("RssFile") / 1e6}


def llamacpp_prose_worker(model: str, runtime: str, context: int, steps: int, runs: int,
                          threads: int, document: str = "") -> dict[str, Any]:
    """llama.cpp over the ids `prose_worker` reads (the same document behind the same chat
    template, or `context` tokens of prose), prefilled by llama.cpp itself, then the same
    question and `steps` tokens, `runs` times."""
    import llama_cpp

    from ktlong.bench.e2e import LLAMACPP_KV
    from ktlong.model import load_tokenizer
    from ktlong.spec import read_spec

    flash, ggml_type = LLAMACPP_KV[runtime]
    ids, q_ids = _chat_ids(load_tokenizer(model), context, document)
    threads = threads or os.cpu_count() or 1
    llm = llama_cpp.Llama(
        model_path=model, n_ctx=len(q_ids) + steps + 64, n_batch=512, n_threads=threads,
        n_threads_batch=threads, flash_attn=flash, type_k=ggml_type, type_v=ggml_type,
        n_gpu_layers=0, verbose=False)
    t0 = time.perf_counter()
    llm.eval(ids)  # the document, read by llama.cpp's own prefill
    fill_s = time.perf_counter() - t0
    row = _llamacpp_runs(llm, ids, q_ids[len(ids):], steps, runs)
    return {"profile": runtime, "kv_type": "Q8_0" if ggml_type == 8 else "F16",
            "kv_tier": "ram", "kv_source": "prose", "context": len(ids),
            "layers": read_spec(model).n_layers, **row, "fill_s": fill_s,
            "open_s": fill_s, "opened_from": "prefill", "kv_bytes": 0, "threads": threads}


def _chat_ids(tok: Any, context: int, document: str) -> tuple[list[int], list[int]]:
    """The document's ids as the chat reads it (template and all) and the ids with the
    question: the whole `document` file, or `context` tokens of real prose."""
    from ktlong.bench import prose
    from ktlong.conversation import Conversation

    if document:
        from ktlong.documents import read_document

        doc = read_document(document).text
    else:
        doc = tok.decode(tok(prose.text(tok, context + 64), add_special_tokens=False)
                         ["input_ids"][:context])
    conv = Conversation(tok, doc)
    return conv.document_ids(), conv.prompt_ids(conv.question_text(QUESTION_TEXT))


def run(contexts: list[int], kv_types: list[str], tier: str, steps: int, runs: int,
        threads: int, gen: tuple[str, int, str] | Path, cache_dir: str, log: Any,
        profiles: tuple[str, ...] = ("default",), peers: tuple[str, ...] = (),
        kv_source: str = "prose", documents: tuple[str, ...] = ()) -> dict[str, Any]:
    """`gen`: the random model's (shape, layers, weights), or a real model's file; kv_source
    "prose" (a real model's chat over real prose, RAM tier) or "random" (random rows);
    `documents`: files a prose run reads whole, one context each (instead of `contexts`)."""
    prose = kv_source == "prose" and isinstance(gen, Path)
    todo = [(0, d) for d in documents] if prose and documents else [(n, "") for n in contexts]
    from ktlong.bench import genmodel
    from ktlong.bench import plot as plotting
    from ktlong.config import ktlong_home

    if isinstance(gen, Path):
        path, desc = gen, gen.name
    else:
        name, layers, weights = gen
        path, origin = genmodel.build(ktlong_home() / "bench-models", name, layers, weights, log)
        desc = f"random {name} widths, {layers} layers, {weights}: {origin}"
    rows = []
    for n, document in todo:
        for profile in profiles:
            for kv_type in kv_types:  # one fresh process each: its memory figures are its own
                what = document or (f"{n:,} tokens of real prose" if prose else
                                    f"{n:,} tokens of random rows, {tier} tier")
                log(f"{profile}: {kv_type} KV, {what} ...")
                args = [str(path), kv_type, n, steps, runs, threads, cache_dir, profile, document] \
                    if prose else [str(path), kv_type, tier, n, steps, runs, threads, cache_dir,
                                   profile]
                rows.append(_spawn(f"{profile} {kv_type}", ["prose", *args] if prose else args))
                rows[-1]["asked"] = n or document
        for peer in peers:
            if prose:
                log(f"{peer}: {document or f'{n:,} tokens of real prose'}, its own prefill ...")
                args = ["llamacpp-prose", str(path), peer, n, steps, runs, threads, document]
            else:
                log(f"{peer}: {n:,} tokens of synthetic KV ...")
                args = ["llamacpp", str(path), peer, n, steps, runs, threads]
            rows.append(_spawn(peer, args, peer_env()))
            rows[-1]["asked"] = n or document
    for r in rows:  # speed over the first row's at the same context
        base = next(b for b in rows if b["asked"] == r["asked"])
        r["vs_first_type"] = r["tok_s"] / base["tok_s"]
    return {"bench": "decode-model", "machine": plotting.machine(),
            "model": desc, "weights_bytes": path.stat().st_size, "kv_tier": tier, "steps": steps,
            "runs": runs, "kv_source": "prose" if prose else "random", "rows": rows}


def _spawn(name: str, args: list[Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    """One worker in a fresh process (its memory figures are its own): its JSON row."""
    proc = subprocess.run([sys.executable, "-m", "ktlong.bench.decodemodel", json.dumps(args)],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the {name} worker failed: {tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def print_table(data: dict[str, Any]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    prose = data.get("kv_source") == "prose"
    what = "a chat over real prose" if prose else \
        f"a KV cache of random rows ({data['kv_tier']} tier)"
    table = Table(title=f"decode of {what}: {data['model']}, median of {data['runs']} runs "
                        f"of {data['steps']} tokens", box=box.SIMPLE_HEAD)
    for col in ("context", "profile", "KV", "tok/s", "question\ns", "x first", "KV\nGB",
                "disk\nMB/tok", "anon\nGB", "file\nGB", "fill\ns", "anch.\ns"):
        table.add_column(col, justify="right")
    for r in data["rows"]:
        table.add_row(f"{r['context']:,}", r.get("profile", "default"), r["kv_type"],
                      f"{r['tok_s']:.2f}", f"{r.get('question_s', 0):.2f}",
                      f"{r['vs_first_type']:.2f}x", f"{r['kv_bytes'] / 1e9:.1f}",
                      f"{r['disk_read_per_token'] / 1e6:.1f}", f"{r['rss_anon_gb']:.2f}",
                      f"{r['rss_file_gb']:.2f}", f"{r['fill_s']:.0f}", f"{r['anchors_s']:.0f}")
    console = Console()
    console.print(table)
    for peer in (r for r in data["rows"] if r["profile"] in PEERS):
        for r in data["rows"]:
            if r["context"] == peer["context"] and r["profile"] not in PEERS:
                console.print(f"{r['context']:,} tokens: ktlong {r['profile']} ({r['kv_type']} "
                              f"KV) decodes at {r['tok_s'] / peer['tok_s']:.2f}x "
                              f"{peer['profile']} ({peer['kv_type']} KV)")
    console.print("x first: tok/s over the first row's at that context; question s: the "
                  f"{QUESTION}-token question's prefill (and its votes); disk MB/tok: bytes "
                  "read from the disk per decoded token; anon / file GB: RssAnon / RssFile "
                  "after the decode; " + ("fill: seconds to read the document (prefill) or map "
                                          "it from the prompt cache" if prose else
                                          "fill, anch.: seconds to write the synthetic KV and "
                                          "build its anchors"))


if __name__ == "__main__":
    _args = json.loads(sys.argv[1])
    _workers = {"llamacpp": llamacpp_worker, "llamacpp-prose": llamacpp_prose_worker,
                "prose": prose_worker}
    print(json.dumps(_workers[_args[0]](*_args[1:]) if _args[0] in _workers else worker(*_args)))
