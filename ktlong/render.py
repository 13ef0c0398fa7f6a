"""Terminal output of the one-shot commands (memcheck, inspect config): rich tables or JSON.

Consoles are made per call so `NO_COLOR` (honoured by rich) and test redirections are always seen.
"""
from __future__ import annotations

import json
import sys
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ktlong import memory


def console(stderr: bool = False) -> Console:
    """A rich console on stdout (or stderr); colour off when NO_COLOR is set or not a terminal."""
    return Console(file=sys.stderr if stderr else sys.stdout, highlight=False)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def _yes(flag: bool | None) -> str:
    return "-" if flag is None else ("[green]yes[/]" if flag else "[red]no[/]")


def memcheck(r: dict[str, Any], configured: int, written: str | None) -> None:
    """The memcheck table: KV size per length, what fits, the recommended max_seq_len."""
    out = console()
    out.soft_wrap = True  # sentences and paths are not cut; tables still fit the width
    gpu = r["free_gpu_bytes"]
    src = ("[yellow]no --model given: using a " + escape(r["model"]) + "[/]" if r["reference"]
           else f"model {escape(r['model'])} ({r['arch']})")
    out.print(src)
    out.print(f"{r['n_layers']} layers x {r['n_kv_heads']} KV heads x head_dim {r['head_dim']}, "
              f"{r['kv_type']} KV: [bold]{r['kv_bytes_per_token']:,} bytes per token[/] "
              f"({memory.gb(r['kv_bytes_per_token'] * 131072)} per 128K tokens)")
    estimate = ("~", ", an estimate from config.json: the folder has no weight files") \
        if r.get("weights_estimated") else ("", "")
    out.print(f"weights {estimate[0]}{memory.gb(r['weights_bytes'])} (in {r['weights_on']}"
              f"{estimate[1]}), free DRAM {memory.gb(r['free_dram_bytes'])}, "
              + ("no CUDA GPU" if gpu is None else f"free GPU {memory.gb(gpu)}"))
    table = Table("context", "tokens", "KV cache", "DRAM need", "fits",
                  *(("GPU prefill peak", "fits GPU") if gpu is not None else ()))
    for row in r["rows"]:
        label = row["label"].replace(" (model max)", "*").replace("model max", "model max*")
        gpu_cells = () if gpu is None else (memory.gb(row["gpu_need"]), _yes(row["fits_gpu"]))
        table.add_row(label, f"{row['tokens']:,}", memory.gb(row["kv_bytes"]),
                      memory.gb(row["dram_need"]), _yes(row["fits_dram"]), *gpu_cells)
    out.print(table)
    out.print(f"* the model's own maximum context. DRAM need = {r['headroom']}.")
    rec = r["recommended_max_seq_len"]
    if rec == 0:
        out.print("[red]Not even 1K tokens fit next to the weights: free memory, or use a smaller "
                  "model or kv_type.[/]")
    else:
        out.print(f"recommended max_seq_len: [bold]{rec:,}[/] (configured: {configured:,})")
    if written:
        out.print(f"wrote max_seq_len: {rec} to {escape(written)}")
    elif rec and configured > rec:
        out.print(f"[yellow]the configured max_seq_len {configured:,} does not fit; run "
                  "`ktlong memcheck --write` (with your --model) to lower it[/]")


def settings(resolved: Any, explain: bool, keys: list[str] | None = None) -> None:
    """Effective settings with the source of each; `explain` adds allowed values and meaning."""
    from ktlong.config import FIELDS

    out = console()
    out.soft_wrap = True
    table = Table("key", "value", "source", *(("allowed", "meaning") if explain else ()))
    values = resolved.settings.to_dict()
    for key in keys or FIELDS:
        spec = FIELDS[key]
        src = resolved.sources[key]
        shown = "[dim]default[/]" if src == "default" else escape(src.split(":")[0]
                                                                 if src.startswith("config:")
                                                                 else src)
        extra = (spec.allowed(), spec.description) if explain else ()
        value = repr(values[key]) if isinstance(values[key], str) else str(values[key])
        table.add_row(key, escape(value), shown, *map(escape, extra))
    out.print(table)
    out.print(f"config file: {escape(str(resolved.config_file))}")


def cache_entries(rows: list[dict[str, Any]], removed: list[str]) -> None:
    """`ktlong inspect cache`: the prompt-cache entries as a table."""
    import time

    out = console()
    for key in removed:
        out.print(f"removed {key}")
    if not rows:
        out.print("the prompt cache is empty")
        return
    table = Table(title="prompt cache (--json: full keys, paths, creation times)",
                  box=box.SIMPLE_HEAD)
    for col in ("key", "kind", "model", "tokens", "kv", "size", "last used"):
        table.add_column(col, justify="right" if col in ("tokens", "size") else "left",
                         overflow="fold")  # wrap, never cut

    def when(t: float | None) -> str:
        return time.strftime("%m-%d %H:%M", time.localtime(t)) if t else "?"

    for r in rows:
        model = str(r["model"]).rstrip("/").rsplit("/", 1)[-1]
        table.add_row(r["key"][:8], r["kind"] + ("" if r["ok"] else " (damaged)"),
                      escape(model), f"{r['tokens'] or 0:,}", str(r["kv_type"]),
                      memory.size(r["bytes"]), when(r["last_used"]))
    out.print(table)
