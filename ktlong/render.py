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


def _fits(row: dict[str, Any]) -> str:
    """Where a row's context fits: RAM (either tier), the disk tier only, or nowhere."""
    if row["fits_dram"]:
        return "[green]RAM[/]"
    if row["fits_disk_tier"]:
        return "[yellow]disk[/]"
    return "[red]no[/]" if row["fits_disk_tier"] is False else "[red]no RAM[/]"


def memcheck(r: dict[str, Any], configured: dict[str, Any], written: str | None) -> None:
    """The memcheck table: per length and kv_type, what the RAM tier and the disk tier need and
    which fits; the longest contexts; the recommended max_seq_len, kv_type and kv_tier."""
    out = console()
    out.soft_wrap = True  # sentences and paths are not cut; tables still fit the width
    gpu, disk = r["free_gpu_bytes"], r["free_disk_bytes"]
    types = r["kv_types"]
    src = ("[yellow]no --model given: using a " + escape(r["model"]) + "[/]" if r["reference"]
           else f"model {escape(r['model'])} ({r['arch']})")
    out.print(src)
    per = ", ".join(f"{t} [bold]{r['kv_bytes_per_token'][t]:,}[/]" for t in types)
    local = (f" ({r['sliding_layers']} of them sliding-window layers holding "
             f"{r['sliding_window']:,} tokens, whatever the length)" if r.get("sliding_layers")
             else "")
    out.print(f"{r['n_layers']} layers{local} x {r['n_kv_heads']} KV heads x head_dim "
              f"{r['head_dim']}; KV bytes per token: {per}")
    estimate = ("~", ", an estimate from config.json: the folder has no weight files") \
        if r.get("weights_estimated") else ("", "")
    out.print(f"weights {estimate[0]}{memory.gb(r['weights_bytes'])} (in {r['weights_on']}"
              f"{estimate[1]}); free: RAM {memory.gb(r['free_dram_bytes'])}, "
              + ("disk unknown" if disk is None else
                 f"disk {memory.gb(disk)} ({escape(str(r['disk_folder']))})") + ", "
              + ("no CUDA GPU" if gpu is None else f"GPU {memory.gb(gpu)}"))
    past = any(row["past_trained"] for row in r["rows"])
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("context", "tokens", "KV", "KV cache", "RAM tier\nRAM", "disk tier\nRAM",
                "disk tier\ndisk", "fits", *(("GPU\npeak", "fits\nGPU") if gpu is not None
                                             else ()), *(("past\ntrained",) if past else ())):
        table.add_column(col, justify="left" if col in ("context", "KV", "fits", "past\ntrained")
                         else "right")
    dense, locret = r["attention"] == "DENSE", r["attention"] == "LOCRET"
    last = None
    for row in r["rows"]:
        label = row["label"].replace(" (model max)", "*").replace("model max", "model max*")
        first = row["tokens"] != last
        last = row["tokens"]
        gpu_cells = () if gpu is None else (memory.gb(row["gpu_need"]), _yes(row["fits_gpu"]))
        past_cell = () if not past else (
            ("[red]unseen[/]" if dense else "[yellow]kept[/]" if locret else "[yellow]blocks[/]")
            if row["past_trained"] else "",)
        table.add_row(label if first else "", f"{row['tokens']:,}" if first else "",
                      row["kv_type"], memory.size(row["kv_bytes"]), memory.size(row["dram_need"]),
                      memory.size(row["disk_tier_dram"]), memory.size(row["disk_need"]),
                      _fits(row),
                      *gpu_cells, *past_cell)
    out.print(table)
    out.print(f"* the model's own maximum context. RAM tier: {r['headroom']}. Disk tier: the KV "
              f"in a file (disk, {r['disk_reserve_bytes'] / memory.GIB:g} GiB kept free), in RAM "
              f"{r['disk_headroom']}. fits: RAM = in RAM, disk = only with the KV on disk.")
    if past:
        out.print(f"past trained: longer than the model's trained context "
                  f"({r['trained_context']:,} tokens); "
                  + ("attention DENSE reads it from distances the model was never trained on."
                     if dense else "LOCRET keeps its budget of it, placed within it."
                     if locret else "read with blocks: a decode step reads "
                     f"{r['step_tokens']:,} tokens, none from further, whatever the length."))
    if r.get("measured"):
        m = r["measured"]
        out.print(f"measured answers of this model ({m['profile']} profile, {m['haystack']} "
                  f"haystack; docs/benchmarks.md): {m['line']}.")
    loc = r["locret"]
    out.print(("attention LOCRET" if r["attention"] == "LOCRET" else
               "with attention LOCRET (profile locret)") + f": the KV holds {loc['budget']:,} "
              f"tokens of the document + one {loc['rows'] - loc['budget']:,}-token chunk per "
              "layer, whatever its length (" + ", ".join(
                  f"{t} {memory.size(loc['kv_bytes'][t])}" for t in types)
              + "); what it does not keep is gone.")
    lab = memory.tokens_label
    out.print("longest context in free RAM: " + ", ".join(
        f"{t} {lab(r['longest'][t]['RAM'])}" for t in types))
    if disk is not None:
        out.print("longest with the KV on disk: " + ", ".join(
            f"{t} {lab(r['longest'][t]['DISK'])}" for t in types))
    rec = r["recommended"]
    if rec["max_seq_len"] == 0:
        out.print("[red]Not even 1K tokens fit next to the weights, in RAM or with the KV on "
                  "disk: free memory, or use a smaller model or kv_type.[/]")
    else:
        out.print(f"recommended: [bold]max_seq_len {rec['max_seq_len']:,}, kv_type "
                  f"{rec['kv_type']}, kv_tier {rec['kv_tier']}[/] ({rec['why']})")
    n, auto = configured["max_seq_len"], configured["auto"]
    length = ("auto (what fits the model loaded)" if not n else f"{n:,} (auto: what fits this "
              "model)") if auto else f"{n:,}"
    out.print(f"configured: max_seq_len {length}, kv_type {configured['kv_type']}, kv_tier "
              f"{configured['kv_tier']}")
    other = any(configured[k] != rec[k] for k in ("kv_type", "kv_tier"))
    # auto already holds what fits in RAM for this model: only a longer reach is worth writing
    worth = (rec["max_seq_len"] > n if n else other) if auto else rec["max_seq_len"] != n or other
    if written:
        out.print(f"wrote max_seq_len: {rec['max_seq_len']}, kv_type: {rec['kv_type']}, "
                  f"kv_tier: {rec['kv_tier']} to {escape(written)}")
    elif rec["max_seq_len"] and worth:
        out.print("[yellow]run `ktlong memcheck --write` (with your --model) to store the "
                  "recommendation[/]")


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
