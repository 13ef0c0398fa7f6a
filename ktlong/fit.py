"""Settings fitted to the model a command loads (DESIGN.md: no step reads a key from a distance the
model was never trained on).

- The sparse budget: what a decode step reads (init_len + second_select_num blocks +
  local_windows_len; the question's blocks are taken from second_select_num) and what the window
  prefill reads (init_len + prefill_window) fit in 3/4 of the model's trained context; the last
  quarter is room for a prefill chunk, the partial block and the answer (`prefill_chunk`: an
  automatic chunk after a window is cut to that room, as CUDA's 4,096 would not fit it for a
  model trained at 8K). Keys the user set keep their values (one warning when they read past
  the trained context); the others shrink, block_size and init_len kept: the blocks in
  proportion to the room, the local window by the square of it, so a small budget goes to the
  blocks the question chose rather than to the text just before it (an 8K model: 512 tokens of
  window and 43 blocks; docs/benchmarks.md measures this on SmolLM2 from 16K to 128K). A model
  trained at 22K tokens or more keeps the defaults (16.5K a step).
- max_seq_len 0: what fits in free memory for this model, up to 1M tokens (past its trained
  context: sparse attention reads it in blocks); with attention DENSE up to its max positions.

Commands call `fit_to_model` once they know the model and before it loads; `Resolved.sources`
then says which values were fitted and `Resolved.notes` has the lines to show.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ktlong.config import FIELDS, Resolved, Settings, window_reads

BUDGET_SHARE = (3, 4)  # of the trained context: what one step (or the prefill window) may read
BUDGET_KEYS = ("init_len", "second_select_num", "local_windows_len", "prefill_window")
AUTO_FLOOR = 4096  # max_seq_len 0 never resolves below this: the preflight then says what fits


def explicit(resolved: Resolved, key: str) -> bool:
    """Whether the user set `key`: a flag or KTLONG_ variable always; config.yaml or a profile
    when the value is not the built-in default (config.yaml starts as a copy of the defaults, and
    the default profile spells them out)."""
    src = resolved.sources[key]
    if src == "flag" or src.startswith("env:"):
        return True
    return src != "default" and getattr(resolved.settings, key) != FIELDS[key].default


def step_reads(st: Settings) -> int:
    """Tokens a sparse decode step reads: first tokens, selected blocks, local window."""
    return st.init_len + st.second_select_num * st.block_size + st.local_windows_len


def _fit_decode(st: Settings, cap: int, mine: set[str]) -> dict[str, int]:
    """second_select_num and local_windows_len (those the user left) shrunk so a step reads at
    most `cap` tokens: the window by the square of the share of the room left, the blocks take
    the rest; or the one left takes the room. Nothing changes when the user's own keys already
    fill `cap`."""
    bs, sel, local = st.block_size, st.second_select_num, st.local_windows_len
    if st.attention != "SPARSE" or step_reads(st) <= cap:
        return {}
    left = [k for k in ("second_select_num", "local_windows_len") if k not in mine]
    room = cap - st.init_len - (0 if "second_select_num" in left else sel * bs) \
        - (0 if "local_windows_len" in left else local)
    if not left or room <= 0:  # the user's own keys already read past it: theirs to keep
        return {}
    if len(left) == 2:  # the window shrinks by the square of the share left
        full = sel * bs + local
        local_fit = max(bs, local * room * room // (full * full) // bs * bs)
        sel_fit = (room - local_fit) // bs
    elif left == ["local_windows_len"]:
        local_fit, sel_fit = max(bs, room // bs * bs), sel
    else:
        local_fit, sel_fit = local, room // bs
    out = {"second_select_num": min(sel, max(sel_fit, 0)),
           "local_windows_len": min(local, local_fit)}
    return {k: v for k, v in out.items() if v != getattr(st, k)}


def _fit_prefill(st: Settings, cap: int, mine: set[str]) -> dict[str, int]:
    if "prefill_window" in mine or window_reads(st) <= cap:
        return {}
    return {"prefill_window": max(st.block_size, (cap - st.init_len) // st.block_size
                                  * st.block_size)}


def prefill_chunk(st: Settings, spec: Any, cuda: bool) -> int:
    """Tokens per prefill chunk: `chunk_size`, or when it is 0 the device's size, cut so a
    windowed chunk's queries read no key past the model's trained context."""
    from ktlong.config import CHUNK_AUTO
    from ktlong.spec import trained_context

    if st.chunk_size:
        return st.chunk_size
    n, reach, trained = CHUNK_AUTO[cuda], window_reads(st), trained_context(spec)
    if reach and trained > reach:
        n = min(n, max(st.block_size, (trained - reach) // st.block_size * st.block_size))
    return n


def fit_budget(resolved: Resolved, trained: int) -> Resolved:
    """The sparse budget fitted to a model trained at `trained` tokens (see the module doc)."""
    st, mine = resolved.settings, {k for k in BUDGET_KEYS if explicit(resolved, k)}
    cap = trained * BUDGET_SHARE[0] // BUDGET_SHARE[1]
    decode = _fit_decode(st, cap, mine)
    changed = decode | _fit_prefill(st, cap, mine)
    fitted = dataclasses.replace(st, **changed)
    label = f"fitted to the model's trained context {trained:,}"
    sources = resolved.sources | dict.fromkeys(changed, label)
    notes = []
    if changed:
        what = ", ".join(f"{k} {v:,}" for k, v in changed.items())
        step = f" (a decode step reads {step_reads(fitted):,} tokens)" if decode else ""
        notes.append(f"note: {label} tokens: {what}{step}; set them to keep your own")
    over = [f"a decode step reads {step_reads(fitted):,} tokens"] \
        if st.attention == "SPARSE" and step_reads(fitted) > trained else []
    if window_reads(fitted) > trained:
        over.append(f"the prefill window {window_reads(fitted):,}")
    if over:
        who = ", ".join(f"{k} {getattr(fitted, k):,} from {_origin(sources[k])}"
                        for k in BUDGET_KEYS if k in mine)
        notes.append(f"warning: {' and '.join(over)}" + (f" ({who})" if who else "")
                     + f", past the model's trained context ({trained:,} tokens): keys are read "
                     "from distances it was never trained on")
    return dataclasses.replace(resolved, settings=fitted, sources=sources,
                               notes=resolved.notes + tuple(notes))


def _origin(source: str) -> str:
    return "config.yaml" if source.startswith("config:") else source


def auto_max_seq_len(spec: Any, st: Settings, free_dram: int | None = None,
                     free_disk: int | None = None) -> tuple[int, str]:
    """max_seq_len 0 for this model: the longest context its KV keeps in free RAM (kv_tier DISK:
    on free disk), up to 1M tokens (DENSE: its max positions); and why, as a source label.
    The weights are counted in RAM, as on a machine without a GPU."""
    from ktlong import memory

    free = memory.free_dram_bytes() if free_dram is None else free_dram
    cap = memory.full_context(spec, st)
    if st.kv_tier == "DISK":
        disk = memory.free_disk_bytes(memory.tier_folder(st)) if free_disk is None else free_disk
        n = memory.longest_disk_tier(spec, st.kv_type, free, disk, st, cap=cap)
        where = f"with the KV on disk ({memory.gb(disk)} free)"
    else:
        n = memory.recommend_max_seq_len(spec, st.kv_type, free, cap=cap)
        where = f"in free RAM ({memory.gb(free)})"
    return max(n, AUTO_FLOOR), f"auto: what fits {where} for this model, at most " \
        f"{memory.tokens_label(cap)}"


def fit_to_model(resolved: Resolved, spec: Any, free_dram: int | None = None,
                 free_disk: int | None = None) -> Resolved:
    """`resolved` fitted to the model `spec` (a ModelSpec): the sparse budget inside its trained
    context, max_seq_len 0 made a number. Free memory is read now unless given."""
    from ktlong.spec import trained_context

    trained = trained_context(spec)
    if trained > 0:
        resolved = fit_budget(resolved, trained)
    if resolved.settings.max_seq_len == 0:
        n, why = auto_max_seq_len(spec, resolved.settings, free_dram, free_disk)
        resolved = dataclasses.replace(
            resolved, settings=dataclasses.replace(resolved.settings, max_seq_len=n),
            sources=resolved.sources | {"max_seq_len": why})
    return resolved
