"""`ktlong bench agree`: does ktlong's greedy decode give llama.cpp's tokens on the same file?

Each document is tokenized once (ktlong's tokenizer, its BOS included) and cut to a length; ktlong
(a profile, `dense` by default) and llama.cpp (llama-cpp-python, same GGUF, same ids, greedy)
each decode `new` tokens. Reported per document: the tokens in common before the first
difference and, at that difference, ktlong's top-two logit margin (a small margin is a float
rounding tie, not a wrong model) and what each side chose. llama.cpp decodes twice, without and
with flash attention: where those two runs part as early, llama.cpp's own rounding (8-bit
activations, F16 attention) decides the tokens there, and no exact implementation can follow it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ktlong.errors import KtlongError


def _ktlong(lm: Any, profile: str, ids: list[int], new: int, threads: int) -> dict[str, Any]:
    import torch

    from ktlong.config import resolve_settings
    from ktlong.engine import Sampling, Session

    st = resolve_settings(profile, {"threads_num": threads, "max_seq_len": len(ids) + new + 16,
                                    "kv_tier": "RAM"}).settings
    s = Session(dataclasses.replace(lm, eos_ids=()), st)
    s.prefill(ids)
    margins = []

    def margin() -> float:
        top = torch.topk(s.logits.float(), 2).values
        return float(top[0] - top[1])

    margins.append(margin())
    out = []
    for step in s.generate(Sampling(max_new_tokens=new)):
        out.append(step.token_id)
        if len(out) < new:
            margins.append(margin())
    return {"tokens": out, "margins": margins}


def _llamacpp(gguf: str, ids: list[int], new: int, threads: int,
              flash_attn: bool = False) -> list[int]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=gguf, n_ctx=len(ids) + new + 16, n_batch=512,
                          n_threads=threads, n_threads_batch=threads, flash_attn=flash_attn,
                          verbose=False)
    out = []
    for tok in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
        out.append(int(tok))
        if len(out) == new:
            break
    return out


def _common(a: list[int], b: list[int], new: int) -> int:
    """Tokens in common before the first difference."""
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(new, len(a), len(b)))


def run(model: str, docs: list[tuple[str, int]], new: int, profile: str,
        threads: int) -> dict[str, Any]:
    from ktlong.model import load_model

    if not model.endswith(".gguf"):
        raise KtlongError("bench agree needs a GGUF file (llama.cpp reads it)",
                          hint="pass --model with a .gguf file or a known name (smollm2)")
    lm = load_model(model, device="CPU")
    rows = []
    for path, n in docs:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        ids = lm.tokenizer(text)["input_ids"][:n]
        kt = _ktlong(lm, profile, ids, new, threads)
        lc = _llamacpp(model, ids, new, threads)
        lc_fa = _llamacpp(model, ids, new, threads, flash_attn=True)
        same = _common(kt["tokens"], lc, new)
        row = {"document": path, "prompt_tokens": len(ids), "new": new, "agree": same,
               "llamacpp_self": _common(lc, lc_fa, new), "ktlong": kt["tokens"],
               "llamacpp": lc, "llamacpp_flash_attn": lc_fa}
        if same < new:
            row.update(margin=kt["margins"][same], ktlong_token=kt["tokens"][same],
                       llamacpp_token=lc[same],
                       text=lm.tokenizer.decode(kt["tokens"][:same + 1]))
        rows.append(row)
    return {"model": model, "profile": profile, "threads": threads, "rows": rows}


def print_table(data: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=f"greedy tokens, ktlong ({data['profile']}) vs llama.cpp: {data['model']}")
    for c in ("document", "prompt", "same tokens", "first difference",
              "llama.cpp vs itself (flash attn)"):
        t.add_column(c)
    for r in data["rows"]:
        diff = "none" if r["agree"] == r["new"] else (
            f"token {r['agree']}: ktlong {r['ktlong_token']}, llama.cpp {r['llamacpp_token']} "
            f"(ktlong's top-2 margin {r['margin']:.3f})")
        t.add_row(escape(Path(r["document"]).name), f"{r['prompt_tokens']:,}",
                  f"{r['agree']} of {r['new']}", diff, f"{r['llamacpp_self']} of {r['new']}")
    Console().print(t)
