"""`ktlong prefill`: compute a document's KV cache once and keep it on disk for later chats.

The document is rendered exactly as `ktlong chat` renders it (same template head, same ids), so
the entry written here is the one a later chat on the same model and document maps in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ktlong.config import Settings
from ktlong.errors import KtlongError


def run(
    model: Path | None,
    prompt_file: str | list[str],
    settings: Settings,
    *,
    system: str | None = None,
    encoding: str | None = None,
    cache_dir: Path | None = None,
    as_json: bool = False,
) -> dict[str, Any]:
    from ktlong import chatui, render
    from ktlong.bench.rss import peak_rss
    from ktlong.conversation import Conversation
    from ktlong.documents import check_length, read_document
    from ktlong.model import load_model
    from ktlong.promptcache import open_document
    from ktlong.spec import read_spec
    from ktlong.tokenids import TokenIds

    if model is None:
        raise KtlongError(
            "no model given", hint="pass --model with a Hugging Face folder or a .gguf file"
        )
    read_spec(model)
    doc = read_document(prompt_file, encoding)
    ui = chatui.TerminalUI(as_json=as_json)
    with ui.loading(model):
        lm = load_model(model, settings.device, weight_type=settings.weight_type)
    check_length(doc, lm.tokenizer, settings.max_seq_len)  # before tokenizing it
    ids = TokenIds(Conversation(lm.tokenizer, doc.text, system).document_ids())  # 4 B a token
    peak_rss(reset=True)  # from here: what reading the document takes
    with ui.progress("prefilling") as progress:
        opened = open_document(lm, settings, ids, progress, True, cache_dir)
    peak = peak_rss()
    if opened.entry is None:
        raise KtlongError(f"the prompt cache could not be written: {opened.note}")
    st = opened.session.stats
    result = {
        "entry": str(opened.entry),
        "bytes": opened.entry.stat().st_size,
        "tokens": len(ids),
        "source": opened.source,
        "prefill_s": st.prefill_s,
        "prefill_tok_s": st.prefill_tok_s,
        "peak_rss_bytes": peak,  # of the process while the document was read (or mapped)
        "kv_bytes": opened.session.store.nbytes_used(),
        "note": opened.note,
    }
    if as_json:
        render.print_json(result)
    else:
        how = (
            "already cached"
            if opened.source == "cache"
            else f"prefilled in {st.prefill_s:.1f} s ({st.prefill_tok_s:,.0f} tok/s)"
        )
        render.console(stderr=True).print(
            f"{doc.name}: {len(ids):,} tokens {how}\n"
            f"cache entry: {opened.entry} ({result['bytes'] / 1e9:.2f} GB); peak RSS while "
            f"reading {peak / 1e9:.2f} GB"
        )
    return result
