"""Kernels compile before anything is timed, once: warm-up covers what a run uses, stats never
count compile time, and a second process loads every kernel from the cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.models import gguf_model, hf_model, settings

ROOT = Path(__file__).resolve().parents[1]

# The children append the repo root to sys.path (for `tests`), after site-packages: on its front,
# kernels/ would shadow the `kernels` package transformers imports.
CHILD = r"""
import json, sys, time
sys.path.append(sys.argv[2])
t0 = time.perf_counter()
from ktlong import kernels, warmup
from ktlong.engine import Sampling, Session
from ktlong.model import load_model
from tests.models import settings

lm = load_model(sys.argv[1])
st = settings(kv_type="BF16", anchor_type="DYNAMIC", preselect_block=True)
s = Session(lm, st)
ids = [2 + i % 200 for i in range(400)]
s.prefill(ids)
steps = list(s.generate(Sampling(max_new_tokens=6)))
hits, misses = warmup.compile_stats()
print(json.dumps({"hits": hits, "misses": misses, "compile_s": warmup.compile_seconds(),
                  "cache_dir": str(kernels.cache_dir()), "steps": len(steps),
                  "prefill_tok_s": s.stats.prefill_tok_s, "wall_s": time.perf_counter() - t0}))
"""


def _run(model: Path, env: dict[str, str]) -> tuple[dict, str]:
    p = subprocess.run([sys.executable, "-c", CHILD, str(model), str(ROOT)], cwd=model.parent,
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def _cache_files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.suffix in (".nbi", ".nbc")}


def test_second_process_loads_every_kernel_from_the_cache(ktlong_home):
    """Two fresh processes, one KTLONG_HOME: the second compiles nothing (no cache miss, no
    compile time, no new cache file, no "compiling kernels" line)."""
    model = gguf_model("llama", "Q8_0")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KTLONG_")}
    env["KTLONG_HOME"] = str(ktlong_home)
    # NUMBA_CACHE_DIR (conftest: pytest's cache) stays, so a test session compiles once; without
    # it the cache is KTLONG_HOME/numba-cache/<hash>
    first, _ = _run(model, env)
    cache = Path(first["cache_dir"])
    assert first["steps"] == 6 and first["hits"] + first["misses"] > 0
    before = _cache_files(cache)
    assert before  # every kernel the run used is on disk
    second, err = _run(model, env)
    assert second["cache_dir"] == first["cache_dir"]
    assert second["misses"] == 0 and second["compile_s"] == 0.0
    assert second["hits"] > 0  # outer kernels only: a cached kernel holds the ones it calls
    assert _cache_files(cache) == before
    assert "compiling kernels" not in err


RUN = r"""
import json, sys
sys.path.append(sys.argv[3])
from ktlong import warmup
from ktlong.engine import Sampling, Session
from ktlong.model import load_model
from ktlong.promptcache import open_document
from tests.models import gguf_model, settings

scenario, path = sys.argv[1], sys.argv[2]
if scenario == "llama":
    lm = load_model(str(gguf_model("llama", "Q8_0")))
    st = settings(kv_type="BF16", anchor_type="DYNAMIC", preselect_block=True,
                  prefill="MINFERENCE", head_select_mode="SEPARATE", question_blocks=2,
                  question_votes="NEAR")
    s = Session(lm, st)
    s.router.chunk_attention.dense_below = 0  # MInference from the first chunk
    ids = [2 + i % 300 for i in range(900)]
    s.prefill(ids)
    list(s.generate(Sampling(max_new_tokens=6)))
    s.prefill(ids[:30])
    list(s.generate(Sampling(max_new_tokens=3)))
    open_document(lm, st, ids[:500], cache_dir=path)  # saved
    mapped = open_document(lm, st, ids[:500], cache_dir=path).session  # mapped from the cache
    mapped.prefill(ids[500:540])
    list(mapped.generate(Sampling(max_new_tokens=3)))
elif scenario == "short":  # a document the budget covers: no sparse kernel is needed
    lm = load_model(str(gguf_model("llama", "Q8_0")))
    st = settings(kv_type="BF16", second_select_num=64)
    s = Session(lm, st)
    s.prefill([2 + i % 300 for i in range(300)])
    list(s.generate(Sampling(max_new_tokens=3)))
    print(json.dumps([p.key for p in warmup.parts(lm, st, 300)]), file=sys.stderr)
else:
    from ktlong.tinymodel import make_model

    model = make_model(path + "/gemma", "gemma3_text", layers=6, hidden=64, heads=4,
                       kv_heads=1, head_dim=16, sliding_window=16, seed=3)
    s = Session(load_model(str(model)), settings(kv_type="BF16"))
    assert s.decoder is not None and s.window is not None
    s.prefill([2 + i % 50 for i in range(60)])
    list(s.generate(Sampling(max_new_tokens=4)))
print(json.dumps({k: sorted(map(str, v)) for k, v in warmup.unwarmed_signatures().items()}))
"""


def _unwarmed(scenario: str, tmp_path: Path) -> dict:
    """Kernel signatures a fresh process ran outside a warm-up (compiled or loaded: a fresh
    process holds none before its first warm-up)."""
    p = subprocess.run([sys.executable, "-c", RUN, scenario, str(tmp_path), str(ROOT)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_warm_up_covers_what_a_run_compiles(tmp_path):
    """A whole run (MInference prefill, votes, DYNAMIC anchors, preselection, per-head
    selection, the question's blocks voted as they are read, a second turn, a prompt-cache save
    and mapped load, GGUF weights) runs no kernel signature outside the warm-ups its Session
    made before each prefill and answer."""
    assert _unwarmed("llama", tmp_path) == {}


def test_a_short_context_warms_no_sparse_kernel(tmp_path):
    """A context the budget covers warms the dense decode, the weights and the layer kernels
    only, and still runs nothing outside a warm-up (a fresh install's first answer on a short
    document compiles no sparse kernel)."""
    from ktlong import warmup
    from ktlong.model import load_model

    lm = load_model(str(gguf_model("llama", "Q8_0")))
    st = settings(kv_type="BF16", second_select_num=64)
    kinds = {p.kind for p in warmup.parts(lm, st, 300)}
    assert kinds == {"decode", "weights"}
    assert {p.kind for p in warmup.parts(lm, st, 64 * 1024)} >= {"decode", "sparse", "weights"}
    assert _unwarmed("short", tmp_path) == {}


def test_stats_leave_compile_time_out(monkeypatch):
    """A kernel compiling inside a prefill or a decode step is not counted as their work."""
    from ktlong import engine
    from ktlong.engine import Sampling, Session
    from ktlong.model import load_model

    lm = load_model(str(hf_model("llama")))
    s = Session(lm, settings())
    clock = iter(range(0, 10**6, 100))  # every compile_seconds() call: 100 s more compiling
    monkeypatch.setattr(engine, "compile_seconds", lambda: float(next(clock)))
    s.prefill([2 + i for i in range(40)])
    assert s.stats.prefill_s == 0.0  # all of it was "compiling" (clamped, never negative)
    st = [step.stats for step in s.generate(Sampling(max_new_tokens=3))][-1]
    assert st.new_tokens == 3 and st.decode_tok_s == 0.0


def test_warm_up_covers_a_sliding_window_models_decode(tmp_path):
    """Gemma 3: the decode step's window attention and its other small kernels are compiled by
    the warm-up, not on the first token."""
    assert _unwarmed("gemma", tmp_path) == {}
