"""`ktlong inspect model` and `ktlong inspect attention`: what a model is, what the selection reads.

`model_info` reads metadata only (`ktlong.spec.read_spec`). `observe_attention` opens a document
the way the chat does, decodes a few answer tokens while recording every layer's block selection,
and hands the records to `ktlong.attnmap` for the numbers. The rest of this module renders: rich
in the terminal, JSON for scripts, and a PNG through matplotlib (the optional `ktlong[plot]`).
"""
from __future__ import annotations

import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ktlong import render
from ktlong.attnmap import INIT, LOCAL, AttentionReport, SelectionRecorder, StepRecord, analyse
from ktlong.config import Settings
from ktlong.errors import KtlongError

# --- inspect model ------------------------------------------------------------------------------

def model_info(path: str | Path, kv_type: str) -> dict[str, Any]:
    """Everything `inspect model` shows, from metadata alone (config.json + safetensors headers,
    or GGUF key/values and tensor infos)."""
    from ktlong.memory import kv_bytes_per_token
    from ktlong.spec import read_spec

    spec = read_spec(path, need_weights=False)  # metadata is enough
    scaling = spec.rope_scaling or {}
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    return {
        "path": spec.path, "format": spec.format, "arch": spec.arch,
        "n_params": spec.n_params, "n_layers": spec.n_layers, "n_heads": spec.n_heads,
        "n_kv_heads": spec.n_kv_heads, "head_dim": spec.head_dim,
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size, "max_positions": spec.max_positions,
        "rope": {"type": rope_type, "theta": spec.rope_theta, "scaling": spec.rope_scaling},
        "weight_types": spec.weight_types, "weights_bytes": spec.weights_bytes,
        "weights_estimated": spec.weights_estimated,
        "has_chat_template": spec.has_chat_template,
        "kv_type": kv_type, "kv_bytes_per_token": kv_bytes_per_token(spec, kv_type),
        "sliding_window": spec.sliding_window, "sliding_layers": list(spec.sliding_layers),
        "rope_local_theta": spec.rope_local_theta,
        "fingerprint": spec.fingerprint,
    }


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def show_model(path: Path, kv_type: str, as_json: bool) -> None:
    info = model_info(path, kv_type)
    if as_json:
        render.print_json(info)
        return
    from ktlong.memory import gb

    rope = info["rope"]
    scaling = ", ".join(f"{k} {v}" for k, v in (rope["scaling"] or {}).items()
                        if k not in ("rope_type", "type", "rope_theta"))
    g = info["n_heads"] // max(info["n_kv_heads"], 1)
    rows = [
        ("model", f"{info['path']} ({'GGUF' if info['format'] == 'gguf' else 'Hugging Face'})"),
        ("architecture", info["arch"]),
        ("parameters", f"{_count(info['n_params'])} ({info['n_params']:,})"),
        ("layers", str(info["n_layers"]) + (
            f" ({len(info['sliding_layers'])} sliding-window: each reads the last "
            f"{info['sliding_window']:,} tokens, RoPE base {info['rope_local_theta']:g}; KV kept "
            "for that window only)" if info["sliding_layers"] else "")),
        ("heads", f"{info['n_heads']} query, {info['n_kv_heads']} KV"
                  + (f" (GQA, {g} per KV head)" if g > 1 else "")),
        ("head_dim", str(info["head_dim"])),
        ("hidden / MLP", f"{info['hidden_size']} / {info['intermediate_size']}"),
        ("vocabulary", f"{info['vocab_size']:,}"),
        ("RoPE", f"{rope['type']}, base {rope['theta']:g}" + (f", {scaling}" if scaling else "")),
        ("max positions", f"{info['max_positions']:,}"),
        ("weights", f"{gb(info['weights_bytes'])} loaded: " + ", ".join(
            f"{n} x {t}" for t, n in sorted(info["weight_types"].items(), key=lambda x: -x[1]))
            if not info["weights_estimated"] else f"~{gb(info['weights_bytes'])} loaded "
            "(an estimate from config.json: the folder has no weight files)"),
        ("chat template", "yes" if info["has_chat_template"] else "[red]no[/] (plain prompts)"),
        ("KV per token", f"{info['kv_bytes_per_token']:,} bytes ({info['kv_type']}); "
                         f"{gb(info['kv_bytes_per_token'] * 131072)} per 128K tokens"),
    ]
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, value if key in ("chat template",) else escape(value))
    out = render.console()
    out.soft_wrap = True
    out.print(table)


# --- inspect attention: run -----------------------------------------------------------------------

def chat_prompt(tokenizer: Any, document: str, question: str) -> tuple[list[int], int]:
    """The ids the chat feeds before its first answer (`ktlong.conversation`: template head,
    document, blank line, question, generation prompt) and how many leading ids are the
    document's own prefix, the part the prompt cache shares with `ktlong chat`."""
    from ktlong.conversation import Conversation

    conv = Conversation(tokenizer, document)
    doc_ids, ids = conv.document_ids(), conv.prompt_ids(question)
    assert ids[:len(doc_ids)] == doc_ids, "the conversation's document prefix is not a prefix"
    return ids, len(doc_ids)


@dataclass
class Observed:
    """A session after the observed answer tokens, with what each decode step selected."""

    session: Any
    records: list[StepRecord]
    ids: list[int]  # the prompt: document + question in the chat template
    n_doc: int  # leading ids that are the document's own prefix
    answer: list[int]
    source: str  # "prefill" or "cache"
    note: str = ""  # from the prompt cache, e.g. a damaged entry recomputed


def record_decode(lm: Any, settings: Settings, document: str, question: str,
                  n_answer: int = 8, progress: Any = None) -> Observed:
    """Open the document as the chat does, append the question, decode `n_answer` tokens
    (greedy) and record every layer's committed step at each of those steps."""
    from ktlong.engine import Sampling
    from ktlong.promptcache import open_document

    if not document.strip():
        raise KtlongError("the prompt file is empty")
    ids, n_doc = chat_prompt(lm.tokenizer, document, question)
    opened = open_document(lm, settings, ids[:n_doc] or ids[:1], progress)  # cached like chat
    session = opened.session
    session.extend_to(ids)
    # generate feeds every token it yields but the last: n_answer + 1 tokens = n_answer steps
    sampling = Sampling(max_new_tokens=n_answer + 1, temperature=0.0)
    with SelectionRecorder(session.policy) as rec:
        answer = [step.token_id for step in session.generate(sampling)]
    if not rec.records:
        raise KtlongError("the model ended its answer at once: no decode step to observe",
                          hint="ask a question that needs an answer, or try --tokens")
    return Observed(session, rec.records, ids, n_doc, answer, opened.source, opened.note)


def observe_attention(lm: Any, settings: Settings, document: str, question: str,
                      n_answer: int = 8, progress: Any = None) -> AttentionReport:
    """`record_decode`, then recall, overlap and the block map of the recorded steps."""
    obs = record_decode(lm, settings, document, question, n_answer, progress)
    attn = lm.model.model.layers[0].self_attn
    scale = float(getattr(attn, "scaling", lm.spec.head_dim ** -0.5))
    report = analyse(obs.records, obs.session.store, settings, scale, obs.n_doc)
    report.info = {
        "model": lm.spec.path, "arch": lm.spec.arch, "document_tokens": obs.n_doc,
        "prompt_tokens": len(obs.ids), "source": obs.source, "note": obs.note,
        "answer": lm.tokenizer.decode(obs.answer, skip_special_tokens=True),
        "settings": {k: getattr(settings, k) for k in (
            "attention", "kv_type", "block_size", "init_len", "local_windows_len",
            "second_select_num", "anchor_type", "anchor_num", "head_select_mode",
            "dense_layer_num", "token_step", "layer_step", "preselect_block",
            "preselect_block_count", "layer_budget", "squeeze_ratio")},
        "budgets": layer_budgets(obs.session.policy),
    }
    return report


def layer_budgets(policy: Any) -> list[dict[str, Any]]:
    """Per layer: its input/output cosine over the prefill (None if unmeasured), its group
    (ktlong.squeeze: important, middle, squeezed; dense) and its selected blocks per step."""
    from ktlong.squeeze import GROUP_NAMES

    sims = policy.layer_sims or [None] * len(policy.layer_k)
    return [{"layer": i, "similarity": sim, "group": GROUP_NAMES[g], "budget": k}
            for i, (sim, g, k) in enumerate(zip(sims, policy.layer_group, policy.layer_k,
                                                strict=True))]


def attention_main(model: Path | None, prompt_file: Path, question: str, settings: Settings,
                   profile: str | None, n_answer: int, as_json: bool, png: Path | None) -> None:
    """The `inspect attention` command after the CLI resolved its settings."""
    if model is None:
        raise KtlongError("inspect attention needs a model", hint="pass --model DIR|FILE.gguf")
    if png is not None:
        _need_matplotlib()
    from ktlong.documents import read_document
    from ktlong.model import load_model

    document = read_document(prompt_file).text  # the chat's checks: missing, binary, encoding
    lm = load_model(model, settings.device, weight_type=settings.weight_type)
    with _prefill_progress(quiet=as_json) as progress:
        report = observe_attention(lm, settings, document, question, n_answer, progress)
    report.info["profile"] = profile or "(config)"
    if png is not None:
        write_png(report, png)
        report.info["png"] = str(png)
    if as_json:
        render.print_json(report.to_dict())
    else:
        show_attention(report)


@contextmanager
def _prefill_progress(quiet: bool) -> Iterator[Any]:
    """A transient rich progress bar on stderr for the document's prefill (None when quiet)."""
    if quiet:
        yield None
        return
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TimeRemainingColumn

    with Progress("prefill", BarColumn(), TaskProgressColumn(), TimeRemainingColumn(),
                  console=render.console(stderr=True), transient=True) as bar:
        task = bar.add_task("prefill", total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


# --- inspect attention: terminal ----------------------------------------------------------------

SHADES = "░▒▓█"  # selected: share of steps reading the block, in quarters
MARK_INIT, MARK_LOCAL, MARK_UNREAD = "I", "L", "·"


def map_rows(report: AttentionReport, width: int) -> list[Text]:
    """One rich Text per layer: context blocks bucketed into at most `width` columns. A column
    with an init block shows I, one in the local window L, else the most-read block's shade."""
    m = report.map
    cols = max(1, min(width, m.n_blocks))
    edges = [c * m.n_blocks // cols for c in range(cols + 1)]
    rows = []
    for layer in range(m.share.shape[0]):
        line = Text()
        for c in range(cols):
            a, b = edges[c], max(edges[c + 1], edges[c] + 1)
            kinds, share = m.kind[a:b], float(m.share[layer, a:b].max())
            if (kinds == INIT).any():
                line.append(MARK_INIT, "bold magenta")
            elif (kinds == LOCAL).any():
                line.append(MARK_LOCAL, "bold cyan")
            elif share <= 0:
                line.append(MARK_UNREAD, "dim")
            else:
                line.append(SHADES[min(int(share * len(SHADES) - 1e-9), len(SHADES) - 1)],
                            "green")
        rows.append(line)
    return rows


def show_attention(report: AttentionReport) -> None:
    out = render.console()
    out.soft_wrap = True
    info, m = report.info, report.map
    n_doc, n_prompt = info.get("document_tokens", 0), info.get("prompt_tokens", 0)
    cached = " (from the prompt cache)" if info.get("source") == "cache" else ""
    out.print(f"model {escape(str(info.get('model', '')))}, profile "
              f"{escape(str(info.get('profile', '')))}: {n_doc:,} document tokens{cached} + "
              f"{n_prompt - n_doc:,} question tokens, {report.steps} answer tokens observed")
    if info.get("note"):
        out.print(f"[yellow]{escape(str(info['note']))}[/]")
    squeeze = info.get("settings", {}).get("layer_budget") == "SQUEEZE"
    budgets = {b["layer"]: b for b in info.get("budgets", [])}
    extra = ("similarity", "group", "budget") if squeeze else ()
    table = Table("layer", "recall", "worst step", "reuse recall", "overlap", "blocks read",
                  *extra)
    for x in report.layers:
        style = "red" if x.recall < 0.8 else ("yellow" if x.recall < 0.95 else "")
        b = budgets.get(x.layer, {})
        sim = b.get("similarity")
        cells = (("-" if sim is None else f"{sim:.4f}"), str(b.get("group", "")),
                 str(b.get("budget", ""))) if squeeze else ()
        table.add_row(str(x.layer), Text(f"{x.recall:.1%}", style), f"{x.recall_min:.1%}",
                      f"{x.reuse_recall:.1%}", f"{x.overlap:.0%}",
                      f"{x.blocks_read:.0f} / {x.blocks_total:.0f}" + (" (all)" if x.dense else ""),
                      *cells)
    out.print(table)
    s = info.get("settings", {})
    if squeeze:
        out.print("layer_budget SQUEEZE: similarity = cos(layer input, layer output) over the "
                  f"prefill; the squeezed group keeps {s.get('squeeze_ratio')} of "
                  f"{s.get('second_select_num')} selected blocks per step, the important group "
                  "gets what it frees"
                  + ("" if any(b.get("similarity") is not None for b in budgets.values())
                     else " (not measured: this cache entry predates it, so UNIFORM)"))
    elif s.get("second_select_num") is not None:
        out.print(f"layer_budget UNIFORM: {s['second_select_num']} selected blocks per step in "
                  "every sparse layer")
    label = 8
    width = max(8, out.width - label)
    rows = map_rows(report, width)
    cols = len(rows[0]) if rows else 1
    doc_col = min(cols, m.doc_blocks * cols // max(m.n_blocks, 1))
    ruler = Text(" " * label) + Text("─" * doc_col, "dim") + Text("┄" * (cols - doc_col), "yellow")
    per_col = f", about {m.n_blocks / cols:.3g} per column" if cols < m.n_blocks else ""
    out.print(Text(f"blocks read per layer ({m.n_blocks:,} blocks of {m.block_size} tokens"
                   f"{per_col}):"))
    out.print(ruler)
    for layer, row in enumerate(rows):
        out.print(Text(f"L{layer:<{label - 1}}") + row)
    out.print(Text.assemble(
        " " * label, ("─", "dim"), " document  ", ("┄", "yellow"), " question + answer   ",
        (MARK_INIT, "bold magenta"), " init  ", (MARK_LOCAL, "bold cyan"), " local window  ",
        (SHADES, "green"), " selected (share of steps)  ", (MARK_UNREAD, "dim"), " not read"))
    answer = str(info.get("answer", "")).replace("\n", " ")
    if answer:
        out.print(f"answer so far: {escape(answer[:200])}")
    style = "green" if report.mean_recall >= 0.95 else ("yellow" if report.mean_recall >= 0.8
                                                        else "red")
    out.print(Text(report.advice, style))


# --- inspect attention: PNG ---------------------------------------------------------------------

def _need_matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise KtlongError("--png needs matplotlib, which is not installed",
                          hint="pip install 'ktlong[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_png(report: AttentionReport, path: Path) -> None:
    """The block map (layers x context blocks) above a recall-by-layer plot."""
    plt = _need_matplotlib()
    from matplotlib.ticker import MaxNLocator

    m = report.map
    n_layers = m.share.shape[0]
    img = np.ones((n_layers, m.n_blocks, 3))  # white = not read
    green = np.array([0.0, 0.55, 0.2])
    img -= m.share[..., None] * (1 - green)  # selected: white -> green by share of steps
    img[:, m.kind == INIT] = (0.6, 0.2, 0.7)
    img[:, m.kind == LOCAL] = (0.15, 0.45, 0.85)
    fig, (ax_map, ax_rec) = plt.subplots(2, 1, figsize=(11, 3 + 0.35 * n_layers + 2.5),
                                         height_ratios=[max(n_layers, 2), 3])
    ax_map.imshow(img, aspect="auto", interpolation="nearest",
                  extent=(0, m.n_blocks * m.block_size, n_layers - 0.5, -0.5))
    ax_map.axvline(m.doc_blocks * m.block_size, color="orange", lw=1.2, ls="--")
    ax_map.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_map.set_ylabel("layer")
    ax_map.set_xlabel("context position (tokens); dashed: end of document")
    ax_map.set_title("blocks read: purple init, blue local window, green selected "
                     "(darker = more steps)", fontsize=10)
    layers = [x.layer for x in report.layers]
    ax_rec.bar(layers, [x.recall for x in report.layers], color="seagreen", label="recall")
    ax_rec.plot(layers, [x.reuse_recall for x in report.layers], "o--", color="darkorange",
                label="recall if the previous step's blocks were reused")
    ax_rec.axhline(report.mean_recall, color="gray", ls=":", label=f"mean {report.mean_recall:.1%}")
    ax_rec.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_rec.set_ylim(0, 1.05)
    ax_rec.set_xlabel("layer")
    ax_rec.set_ylabel("attention mass kept")
    ax_rec.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3, fontsize=8,
                  frameon=False)
    fig.suptitle(_wrap(report.advice, 110), fontsize=9)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise KtlongError(f"cannot write {path}: {e.strerror}") from None
    finally:
        plt.close(fig)


def _wrap(text: str, width: int) -> str:
    return "\n".join(textwrap.wrap(text, width))


# --- inspect document ---------------------------------------------------------------------------
CHARS_PER_TOKEN = 4  # the estimate without a tokenizer: English prose with a BPE vocabulary


def token_counter(model: Path) -> Any:
    """text -> token count with `model`'s tokenizer (no special tokens); loads no weights."""
    from ktlong.model import load_tokenizer

    tokenizer = load_tokenizer(model)
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def document_info(doc: Any, count: Any = None) -> dict[str, Any]:
    """What `inspect document` shows of a documents.Document: per file its kind, pages (PDF) or
    chapters (EPUB), characters, tokens (`count(text)`, else an estimate) and what was dropped."""
    def tokens(text: str) -> int:
        return count(text) if count else -(-len(text) // CHARS_PER_TOKEN)

    files = []
    for part in doc.parts or (doc,):
        row: dict[str, Any] = {"name": part.name, "kind": part.kind}
        if part.pages is not None:
            row["chapters" if part.kind == "epub" else "pages"] = part.pages
        row |= {"bytes": part.n_bytes, "characters": len(part.text),
                "tokens": tokens(part.text), "dropped": list(part.dropped)}
        files.append(row)
    return {"name": doc.name, "files": files, "characters": len(doc.text),
            "tokens": tokens(doc.text), "tokens_exact": count is not None,
            "dropped": list(doc.dropped)}


def document_main(sources: list[str], model: Path | None, encoding: str | None, show: bool,
                  as_json: bool) -> None:
    """The `inspect document` command: read as the chat reads, count, report, maybe print."""
    import sys

    from ktlong.documents import read_document

    doc = read_document(sources if len(sources) > 1 else sources[0], encoding, what="file")
    info = document_info(doc, token_counter(model) if model is not None else None)
    if as_json:
        render.print_json(info | ({"text": doc.text} if show else {}))
        return
    if show:
        sys.stdout.write(doc.text)
        sys.stdout.flush()
    table = Table(box=None, pad_edge=False)
    for name, justify in (("file", "left"), ("kind", "left"), ("pages", "right"),
                          ("characters", "right"), ("tokens", "right"), ("dropped", "left")):
        table.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
    approx = "" if info["tokens_exact"] else "~"
    for row in info["files"]:
        pages = (f"{row['pages']:,}" if "pages" in row else
                 f"{row['chapters']:,} chapters" if "chapters" in row else "-")
        table.add_row(escape(row["name"]), row["kind"], pages, f"{row['characters']:,}",
                      f"{approx}{row['tokens']:,}", escape("\n".join(row["dropped"]) or "-"))
    out = render.console(stderr=show)
    out.print(table)
    what = (f"counted with the tokenizer of {model}" if model is not None else
            f"estimated at {CHARS_PER_TOKEN} characters a token; --model counts them")
    several = f" (with the {len(info['files'])} '=== NAME ===' lines)" if doc.parts else ""
    out.print(f"the model reads {info['characters']:,} characters, {approx}{info['tokens']:,} "
              f"tokens{several}; tokens {what}")
    skipped = [d for d in info["dropped"] if d.startswith("skipped ")]
    for line in skipped:
        out.print(escape(line))
