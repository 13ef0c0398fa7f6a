"""`ktlong bench faults`: `ktlong prefill` and `ktlong chat` killed at many points of reading a
document and of writing its cache entry, and what the next chat makes of it.

First an uninterrupted `chat --no-cache` gives the reference answer (greedy ids) and an
uninterrupted `prefill` the time the read and the write take. Then, for each kill point, a child
(`prefill`, or a `chat` that reads the document and writes its entry) in a fresh cache folder gets
SIGKILL or SIGINT: at a share of the read, or a moment after its entry's temporary file appears
(the write). The next `chat` on the same folder must give the reference answer, from the cache or
from a fresh read, and leave no temporary file behind; a SIGINT must end the child with one line,
no traceback.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

QUESTION = "Under what conditions may I redistribute the work?"


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "ktlong", *args]


def _answer(model: str, doc: str, n: int, threads: int, cache: Path | None) -> dict[str, Any]:
    where = ["--no-cache"] if cache is None else ["--cache-dir", str(cache)]
    out = subprocess.run(_cli("chat", "-m", model, "-f", doc, "-q", QUESTION, "-n", str(n),
                              "-t", str(threads), "--json", *where),
                         capture_output=True, text=True, timeout=3600)
    if out.returncode:
        raise RuntimeError(f"chat failed ({out.returncode}): {out.stderr.strip()[-400:]}")
    return json.loads(out.stdout.splitlines()[0])


def _temps(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "entries").glob("*.tmp-*")) \
        if (cache / "entries").exists() else []


def _kill(cmd: list[str], cache: Path, sig: int, at_s: float | None,
          after_write_s: float | None) -> dict[str, Any]:
    """Run `cmd`; send `sig` at `at_s` seconds, or `after_write_s` after a temp file appears."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0, sent, phase = time.perf_counter(), None, ""
    while p.poll() is None:
        now = time.perf_counter() - t0
        writing = bool(_temps(cache))
        if at_s is not None and now >= at_s:
            phase = "write" if writing else "read"
            sent = now
        elif after_write_s is not None and writing:
            time.sleep(after_write_s)
            phase, sent = "write", time.perf_counter() - t0
        if sent is not None:
            p.send_signal(sig)
            break
        time.sleep(0.01)
    _, err = p.communicate(timeout=600)
    lines = [x for x in err.splitlines() if x.strip()]
    return {"killed_at_s": sent, "phase": phase or "finished first", "exit": p.returncode,
            "traceback": any("Traceback" in x for x in lines),
            "last_line": lines[-1] if lines else ""}


def run(model: str, doc: str, points: int = 8, n: int = 16, threads: int = 2) -> dict[str, Any]:
    ref = _answer(model, doc, n, threads, None)
    base = Path(tempfile.mkdtemp(prefix="ktlong-faults-"))
    t0 = time.perf_counter()
    subprocess.run(_cli("prefill", "-m", model, "-f", doc, "-t", str(threads), "--cache-dir",
                        str(base / "whole")), check=True, capture_output=True, timeout=3600)
    whole_s = time.perf_counter() - t0
    trials = []
    shares = [(i + 1) / (points + 1) for i in range(points)]  # of the uninterrupted run
    plan = [("prefill", sig, s * whole_s, None)
            for s, sig in zip(shares, [signal.SIGKILL, signal.SIGINT] * points, strict=False)]
    plan += [(cmd, sig, None, d) for cmd in ("prefill", "chat") for sig in
             (signal.SIGKILL, signal.SIGINT) for d in (0.0, 0.05)]
    for i, (what, sig, at_s, after_write) in enumerate(plan):
        cache = base / f"trial{i}"
        cmd = _cli("prefill", "-m", model, "-f", doc, "-t", str(threads), "--cache-dir",
                   str(cache)) if what == "prefill" else _cli(
            "chat", "-m", model, "-f", doc, "-q", QUESTION, "-n", str(n), "-t", str(threads),
            "--cache-dir", str(cache))
        k = _kill(cmd, cache, sig, at_s, after_write)
        left = _temps(cache)
        after = _answer(model, doc, n, threads, cache)
        trials.append({"command": what, "signal": signal.Signals(sig).name, **k,
                       "temps_left_by_kill": len(left), "temps_after_next_run": len(_temps(cache)),
                       "next_source": after["document_source"],
                       "same_answer": after["answer_ids"] == ref["answer_ids"]})
    return {"model": model, "document": doc, "tokens": ref["prompt_tokens"],
            "uninterrupted_prefill_s": whole_s, "reference": ref["answer"], "trials": trials,
            "all_same": all(t["same_answer"] for t in trials),
            "no_temps_left": all(t["temps_after_next_run"] == 0 for t in trials),
            "sigint_clean": all(not t["traceback"] for t in trials if t["signal"] == "SIGINT")}


def main(model: str, doc: str, points: int, n: int, threads: int, as_json: bool,
         command: str) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    from ktlong.bench import plot as plotting

    result = run(model, doc, points, n, threads)
    result.update(command=command, machine=plotting.machine())
    if as_json:
        print(json.dumps(result, indent=1))
        return result
    t = Table(title=f"killed runs, then a chat ({Path(doc).name}, {result['tokens']:,} tokens; "
                    f"uninterrupted prefill {result['uninterrupted_prefill_s']:.1f} s)")
    for col in ("command", "signal", "killed at s", "phase", "exit", "temp files left / after "
                "next run", "next chat read", "same answer"):
        t.add_column(col)
    for r in result["trials"]:
        at = "-" if r["killed_at_s"] is None else f"{r['killed_at_s']:.1f}"
        t.add_row(r["command"], r["signal"], at, r["phase"], str(r["exit"]),
                  f"{r['temps_left_by_kill']} / {r['temps_after_next_run']}", r["next_source"],
                  "yes" if r["same_answer"] else "NO")
    Console().print(t)
    return result

