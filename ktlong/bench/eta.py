"""`ktlong bench eta`: how true the chat's ETA is while it reads a document.

The chat's own ChatLoop reads the document (no prompt cache) under the command's settings, its
progress bar as in `ktlong chat`; at every update the bench notes the time, the tokens done and
the ETA the bar shows (ktlong.eta). When the read is over, each shown ETA is held against the
time that was really left, and so is the ETA a rate over the last 30 s would have shown (rich's
own, the bar's ETA before ktlong.eta). Reported: the error at 10, 25, 50, 75 and 90% of the read,
the worst error between 10% and 90% (in the last tenth a second's error is a large share of
what is left) and where the first ETA showed (the bar shows none until three chunks are read);
--json keeps every point.
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SHARES = (0.10, 0.25, 0.50, 0.75, 0.90)
RATE_WINDOW_S = 30.0  # rich's speed_estimate_period


def _rate_eta(points: list[tuple[float, int, Any]], i: int, total: int) -> float | None:
    """The time left at point i by the rate over the last RATE_WINDOW_S seconds."""
    t, done, _ = points[i]
    j = i
    while j > 0 and t - points[j - 1][0] <= RATE_WINDOW_S:
        j -= 1
    dt, dn = t - points[j][0], done - points[j][1]
    return (total - done) * dt / dn if dn > 0 and dt > 0 else None


def evaluate(points: list[tuple[float, int, float | None]], total: int) -> dict[str, Any]:
    """Errors of the shown and the rate ETAs (share of the time really left, signed)."""
    end = points[-1][0]
    rows, worst, worst_rate = [], 0.0, 0.0
    for i, (t, done, shown) in enumerate(points[:-1]):
        left = end - t
        if left <= 0 or done < SHARES[0] * total:
            continue
        rate = _rate_eta(points, i, total)
        err = None if shown is None else shown / left - 1
        err_rate = None if rate is None else rate / left - 1
        if done <= SHARES[-1] * total:  # (no ETA yet: the bar shows none, nothing to be off)
            worst = max(worst, abs(err)) if err is not None else worst
            worst_rate = max(worst_rate, abs(err_rate)) if err_rate is not None else worst_rate
        rows.append({"share": done / total, "seconds": t, "left_s": left, "eta_s": shown,
                     "rate_eta_s": rate, "error": err, "rate_error": err_rate})
    at = []
    for share in SHARES:
        r = next((r for r in rows if r["share"] >= share), None)
        if r is not None:
            at.append({**r, "at": share})
    first = next((done / total for _, done, shown in points if shown is not None), None)
    return {"read_s": end, "tokens": total, "first_eta_at": first, "worst_error": worst,
            "worst_rate_error": worst_rate, "at": at,
            "points": [[round(t, 3), done, None if e is None else round(e, 3)]
                       for t, done, e in points]}


def main(model: Path, prompt_file: str, settings: Any, as_json: bool, command: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from ktlong.chat import ChatLoop
    from ktlong.chatui import TerminalUI
    from ktlong.documents import check_length, read_document
    from ktlong.model import load_model

    points: list[tuple[float, int, float | None]] = []

    class UI(TerminalUI):
        @contextmanager
        def progress(self, label: str, min_tokens: int = 0, eta: Any = None):
            with super().progress(label, min_tokens, eta) as update:
                def note(done: int, total: int) -> None:
                    update(done, total)
                    if label == "reading the document":
                        points.append((time.monotonic(), done, eta.remaining() if eta else None))
                yield note

    doc = read_document(prompt_file, None)
    ui = UI()
    lm = load_model(model, settings.device, weight_type=settings.weight_type)
    check_length(doc, lm.tokenizer, settings.max_seq_len)
    loop = ChatLoop(lm, settings, doc, ui, use_cache=False)
    loop.open()
    total = loop.doc_len
    t0 = points[0][0]
    res = evaluate([(t - t0, d, e) for t, d, e in points], total)
    res.update(model=str(model), document=prompt_file, threads=settings.threads_num,
               prefill=settings.prefill, command=command)
    if as_json:
        print(json.dumps(res))
        return
    out = Console()
    tab = Table(title=f"{Path(prompt_file).name}: {total:,} tokens read in {res['read_s']:.1f} s")
    for c in ("at", "left s", "ETA shown s", "error", "30 s rate ETA s", "error"):
        tab.add_column(c, justify="right")

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:+.0%}"

    def sec(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    for r in res["at"]:
        tab.add_row(f"{r['at']:.0%}", sec(r["left_s"]), sec(r["eta_s"]), pct(r["error"]),
                    sec(r["rate_eta_s"]), pct(r["rate_error"]))
    out.print(tab)
    first = res["first_eta_at"]
    out.print(f"first ETA shown at {first:.0%} of the read" if first is not None
              else "no ETA shown")
    out.print(f"worst error from 10% to 90%: shown {res['worst_error']:.0%}, "
              f"30 s rate {res['worst_rate_error']:.0%}")
