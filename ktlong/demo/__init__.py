"""The built-in demo: a small trained model (`model/`) and documents with hidden facts.

`ktlong chat --demo` needs neither a model nor a document: `prepare()` writes a generated document
(pass key, key-value records, a needle at random depths) under KTLONG_HOME/demo and returns it with
the shipped model folder and the questions worth asking.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL_DIR = Path(__file__).parent / "model"
DEMO_TOKENS = 16384
# The demo model's windowed prefill on the CPU, per core: a 128K-token document took ~35 s on
# 2 cores (docs/benchmarks.md). Attention dominates, so an exact prefill (every
# earlier token) takes longer, growing with the square of the length.
PREFILL_TOK_S_PER_CORE = 1800


@dataclass(frozen=True)
class Demo:
    model: Path
    document: Path
    questions: list[str]  # one per hidden fact kind
    n_tokens: int


def cost(n_tokens: int, kv_type: str, model: Path | None = None, threads: int = 0,
         windowed: bool = True, max_seq_len: int | None = None, settings: Any = None) -> str:
    """What a demo document of `n_tokens` costs on this machine, as one line: its KV cache (in RAM,
    and as much again on disk as a prompt-cache entry) and, for the demo model, an estimated
    prefill time. Raises a KtlongError, before the document is written, when its KV cache does
    not fit in free memory (or, when `settings`' kv_tier resolves to DISK, on free disk) or the
    document is longer than `max_seq_len`."""
    import os

    from ktlong import memory
    from ktlong.config import MAX_SEQ_LEN
    from ktlong.errors import KtlongError
    from ktlong.spec import read_spec

    spec = read_spec(model or MODEL_DIR, need_weights=False)
    kv = memory.kv_bytes_per_token(spec, kv_type) * n_tokens
    need, free = memory.dram_need(spec, kv_type, n_tokens), memory.free_dram_bytes()
    where = "in RAM"
    if settings is not None and memory.resolve_tier(spec, settings, free) == "DISK":
        problem = memory.room_problem(spec, settings, n_tokens, free_dram=free)
        if problem is not None:
            raise KtlongError(f"--demo-tokens {n_tokens:,}: {problem.message}", hint=problem.hint)
        where = "on disk (kv_tier DISK)"
    elif need > free:
        fits = memory.recommend_max_seq_len(spec, kv_type, free)
        raise KtlongError(
            f"--demo-tokens {n_tokens:,} needs {memory.gb(need)} of RAM ({memory.size(kv)} of "
            f"{kv_type.upper()} KV cache, +{memory.KV_MARGIN:.0%}, the weights and "
            f"{memory.OS_RESERVE // memory.GIB} GiB for the OS) but {memory.gb(free)} is free",
            hint=f"use --demo-tokens {fits // 1024}K or less" if fits >= 1024
            else "free some memory first")
    line = f"{memory.size(kv)} of KV cache {where}, as much on disk in the prompt cache"
    if model is None:
        try:
            cores = threads or len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cores = threads or os.cpu_count() or 1
        secs = n_tokens / (PREFILL_TOK_S_PER_CORE * cores)
        when = f"~{secs:.0f} s" if secs < 120 else f"~{secs / 60:.0f} min" if secs < 7200 \
            else f"~{secs / 3600:.1f} h"
        line += (f"; prefill {when} on {cores} core{'s' if cores > 1 else ''}"
                 + ("" if windowed else " or much longer (exact prefill)"))
    if max_seq_len is not None and n_tokens >= max_seq_len:
        room = -(-(n_tokens + 4096) // 1024)  # the document + a question and its answer, in K
        raise KtlongError(f"--demo-tokens {n_tokens:,} does not fit in max_seq_len "
                          f"{max_seq_len:,} (it costs {line})",
                          hint=f"pass --max-seq-len {room}K, or fewer --demo-tokens"
                          if room * 1024 <= MAX_SEQ_LEN else "use fewer --demo-tokens")
    return line


def prepare(n_tokens: int = DEMO_TOKENS, seed: int = 0) -> Demo:
    """Write (once) the demo document of about `n_tokens` tokens; seed picks the hidden facts."""
    from ktlong.config import ktlong_home
    from ktlong.demo import tasks
    from ktlong.errors import KtlongError

    if not (MODEL_DIR / "config.json").exists():
        raise KtlongError(f"the demo model is missing from {MODEL_DIR}",
                          hint="train it: python -m ktlong.demo.train --seed 0")
    if n_tokens < 256:
        raise KtlongError(f"--demo-tokens {n_tokens}: the demo document needs at least 256 tokens")
    sample = tasks.demo_sample(seed, n_tokens)
    folder = ktlong_home() / "demo"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"document-{n_tokens}-seed{seed}.txt"
    if not path.exists() or path.read_text(encoding="utf-8") != sample.document:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(sample.document, encoding="utf-8")
        tmp.replace(path)
    return Demo(MODEL_DIR, path, [f.question for f in sample.asked], n_tokens)
