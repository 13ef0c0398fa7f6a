"""Figures for `ktlong bench ... --plot FILE.png` and `ktlong bench plot RESULT.json`.

Each bench's --json output is the dict its figure is drawn from: it names the bench ("bench"), the
command that measured it ("command"), the machine, threads and model, so a saved result redraws
without measuring again. Each bench module keeps its own figure (`plot(data, path) -> Figure`);
this module holds what they share: the matplotlib import, a context-length axis, the title and the
command line under the figure. Importing it does not import matplotlib.
"""
from __future__ import annotations

import importlib
import json
import os
import platform
import textwrap
from pathlib import Path
from typing import Any

from ktlong.errors import KtlongError

MISSING = "--plot needs matplotlib: pip install 'ktlong[bench]'"
# bench name -> the module whose plot(data, path) draws its --json output
MODULES = {"decode": "ktlong.bench.decode", "e2e": "ktlong.bench.e2e",
           "accuracy": "ktlong.demo.accuracy", "cache": "ktlong.bench.cache",
           "prefill": "ktlong.bench.prefill"}


def require() -> None:
    """Fail before measuring anything when matplotlib is missing (one line, exit 2)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise KtlongError(MISSING) from None


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend."""
    require()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def machine() -> str:
    """The CPU's name and its logical cores, for the record: 'AMD EPYC 9R14, 16 cores'."""
    name = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    name = " ".join((name or platform.processor() or platform.machine() or "CPU").split())
    return f"{name}, {os.cpu_count() or 1} cores"


def tokens(n: int) -> str:
    """16384 -> 16K, 1048576 -> 1M, 1000 -> 1000."""
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    return f"{n >> 10}K" if n >= 1024 and n % 1024 == 0 else str(n)


def model_name(model: Any) -> str:
    """A model as the results record it: a shape dict (a random Llama) or a description."""
    if isinstance(model, dict):
        heads = f"{model.get('heads')}/{model.get('kv_heads')} heads"
        return (f"random Llama ({model.get('layers')} layers, hidden {model.get('hidden')}, "
                f"{heads}, d {model.get('head_dim')})")
    return str(model)


def subtitle(data: dict[str, Any], width: int = 100) -> str:
    """'machine, N threads, model' from a result's keys (those it has), broken between the parts
    into lines of about `width` characters."""
    t = data.get("threads")
    parts = [data.get("machine") or "",
             "" if t is None else f"threads: {t}" if not isinstance(t, int)
             else f"{t} thread{'s' if t != 1 else ''}",
             model_name(data["model"]) if data.get("model") else ""]
    lines: list[str] = []
    for part in filter(None, parts):
        if lines and len(lines[-1]) + 2 + len(part) <= width:
            lines[-1] += ", " + part
        else:
            if lines:
                lines[-1] += ","
            lines += textwrap.wrap(part, width) or [part]
    return "\n".join(lines)


def figure(ncols: int = 1, nrows: int = 1, size: tuple[float, float] = (7.5, 4.8),
           **kw: Any) -> tuple[Any, Any]:
    """A figure and its axes array [nrows, ncols] (always 2-D)."""
    plt = pyplot()
    return plt.subplots(nrows, ncols, figsize=size, squeeze=False, **kw)


def context_axis(ax: Any, contexts: list[int], label: str = "context (tokens)") -> None:
    """Log-2 x axis ticked at exactly the measured lengths (16K, 64K, 1M)."""
    xs = sorted(set(contexts))
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [tokens(x) for x in xs])
    ax.minorticks_off()
    if len(xs) == 1:  # one point: give it room
        ax.set_xlim(xs[0] / 1.5, xs[0] * 1.5)
    ax.set_xlabel(label)


def log_y(ax: Any) -> None:
    """Log y axis labelled in plain numbers (0.5, 2, 100), not powers of ten."""
    from matplotlib.ticker import LogFormatter

    class Plain(LogFormatter):  # LogFormatter picks which ticks to label; %g writes them
        def __call__(self, x: float, pos: Any = None) -> str:
            return f"{x:g}" if super().__call__(x, pos) else ""

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(Plain(labelOnlyBase=False))
    ax.yaxis.set_minor_formatter(Plain(labelOnlyBase=False, minor_thresholds=(2, 0.5)))


def finish(fig: Any, path: Path | str, title: str, data: dict[str, Any]) -> Any:
    """Title (what, then machine/threads/model), the measuring command in small monospace text at
    the bottom, tight layout, saved as PNG. Returns the figure (closed to pyplot, still
    inspectable)."""
    plt = pyplot()
    sub = subtitle(data, int(fig.get_figwidth() * 12.5))
    fig.suptitle(title + (f"\n{sub}" if sub else ""), fontsize=10)
    command = data.get("command") or ""
    foot = 0.0  # share of the height the command's lines take (7 pt monospace, wrapped)
    if command:
        fig.text(0.01, 0.012, command, fontsize=7, family="monospace", va="bottom", wrap=True)
        w, h = fig.get_size_inches()
        # ~0.06 in a character; 0.07 leaves room for lines broken between words
        lines = len(textwrap.wrap(command, max(40, int(w / 0.07))))
        foot = min(0.4, 0.02 + lines * 0.125 / h)  # ~0.125 in a line
    fig.tight_layout(rect=(0, foot, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig


def draw(data: dict[str, Any], path: Path | str) -> Any:
    """Draw a saved bench result with the figure of the bench that made it."""
    bench = data.get("bench") if isinstance(data, dict) else None
    if bench is None:
        raise KtlongError("no \"bench\" key: not the --json output of a ktlong bench command",
                          hint=f"redraws the --json of: bench {', '.join(MODULES)}")
    if bench not in MODULES:
        raise KtlongError(f"no figure for bench {bench!r}",
                          hint=f"redraws the --json of: bench {', '.join(MODULES)}")
    require()
    return importlib.import_module(MODULES[bench]).plot(data, path)


def _load(result: Path) -> Any:
    try:
        text = result.read_text()
    except OSError as e:
        raise KtlongError(f"{result}: {e.strerror or e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        try:  # the JSON line after other output (a log line saved with it)
            return json.loads(text.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            raise KtlongError(f"{result}: not JSON ({e.msg} at line {e.lineno})") from None


MERGE_KEYS = ("model", "haystack", "tasks", "lead")  # what runs drawn as one must share


def merge(runs: list[Any], names: list[str]) -> dict[str, Any]:
    """Several `bench accuracy --json` runs of one model, haystack and tasks (e.g. a length
    each) as one result: their records and summaries, their commands one after another."""
    for run, name in zip(runs, names, strict=True):
        if not isinstance(run, dict) or run.get("bench") != "accuracy":
            raise KtlongError(f"{name}: only bench accuracy results are drawn together",
                              hint="give one RESULT.json for the other benches")
    def same(run: dict[str, Any], key: str) -> Any:  # one model file wherever it was run
        v = run.get(key)
        return Path(v).name if key == "model" and isinstance(v, str) else v

    first = runs[0]
    for run, name in zip(runs[1:], names[1:], strict=True):
        for key in MERGE_KEYS:
            if same(run, key) != same(first, key):
                raise KtlongError(f"{name}: its {key} differs from {names[0]}'s",
                                  hint="runs drawn as one share the model, haystack and tasks")
    out = dict(first)
    out["records"] = [r for run in runs for r in run.get("records", [])]
    out["summary"] = [c for run in runs for c in run.get("summary", [])]
    out["command"] = "; ".join(run.get("command", "") for run in runs)
    for key in ("machine", "device", "threads"):  # each as the runs had it
        seen = list(dict.fromkeys(str(run[key]) for run in runs if run.get(key) is not None))
        if len(seen) > 1:
            out[key] = " / ".join(seen)
    return out


def redraw(results: list[Path], path: Path) -> Any:
    """`ktlong bench plot RESULT.json [MORE.json ...] --plot FILE.png` (several: accuracy runs
    drawn as one)."""
    runs = [_load(r) for r in results]
    data = runs[0] if len(runs) == 1 else merge(runs, [str(r) for r in results])
    return draw(data, path)
