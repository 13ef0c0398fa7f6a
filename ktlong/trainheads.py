"""`ktlong train-heads`: fit a model's Locret retaining heads (ktlong.locret) on this machine.

The model stays frozen. Each training document is real text (ktlong.bench.prose: the license
texts and Python's own documentation, or the user's files), sometimes with one line carrying a
reference code; it is read once (dense, exact), then each of its questions is asked and the
model's own greedy answer generated. Every prompt token's label, per KV head, is the largest
scaled logit the answer's queries give it (`locret.cis_labels`); the heads learn it from the
token's [q, k, v] (`locret.features`) with Smooth-L1 plus a smoothness term between neighbours.
A checkpoint is written every few documents, and a run that stops resumes from it, also with
another --docs (the documents come in the same order, so a run cut short at N documents gives
the heads of `--docs N`). At the end, a held-out check: how much of a fact line in documents no
run trains on the heads would rank among a document's top quarter (`fact_kept`).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ktlong import locret
from ktlong.config import Settings
from ktlong.conversation import Conversation

QUESTIONS = (
    "Summarize the text above in one sentence.",
    "What is the text above about?",
    "Which terms does the text above define?",
    "Quote the first sentence of the text above.",
    "Quote the last sentence of the text above.",
)
FACT = "The reference code for this text is {code}."
FACT_QUESTION = "What is the reference code for this text?"
SEED0 = 100_000  # documents of seeds the accuracy benches never draw
HELD_OUT0 = 900_000  # the held-out check's documents


@dataclass(frozen=True)
class TrainConfig:
    docs: int = 160  # training documents
    doc_tokens: int = 1536
    questions: int = 2  # per document (the first a reference-code question half the time)
    answer_tokens: int = 24
    lr: float = 2e-3
    alpha: float = 0.01  # smoothness weight
    hidden: int = locret.HIDDEN
    save_every: int = 10  # documents between checkpoints
    seed: int = 0


class Recorder:
    """Sits where a LOCRET evictor would (AttentionRouter.evictor) and keeps every chunk's
    post-RoPE q `[Hq, C, d]`, k, v `[Hkv, C, d]` per store layer, float32 on the CPU."""

    def __init__(self, n_layers: int) -> None:
        self.active = False
        self.parts: list[list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]] = [
            [] for _ in range(n_layers)]

    def after_chunk(self, slot: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    start: int, scale: float, store: Any) -> None:
        self.scale = scale
        self.parts[slot].append((start, q.float().cpu(), k.float().cpu(), v.float().cpu()))

    def take(self, slot: int, lo: int, hi: int) -> tuple[torch.Tensor, ...]:
        """q, k, v of positions [lo, hi) of `slot` from the recorded chunks (latest wins)."""
        _, q0, k0, _ = self.parts[slot][0]
        q = torch.empty(q0.shape[0], hi - lo, q0.shape[2])
        k, v = torch.empty(k0.shape[0], hi - lo, k0.shape[2]), torch.empty(
            k0.shape[0], hi - lo, k0.shape[2])
        for start, qc, kc, vc in self.parts[slot]:
            a, b = max(lo, start), min(hi, start + qc.shape[1])
            if a < b:
                q[:, a - lo : b - lo] = qc[:, a - start : b - start]
                k[:, a - lo : b - lo] = kc[:, a - start : b - start]
                v[:, a - lo : b - lo] = vc[:, a - start : b - start]
        return q, k, v

    def clear(self) -> None:
        for p in self.parts:
            p.clear()


def _document(tokenizer: Any, n_tokens: int, seed: int, fact: bool) -> tuple[str, str | None]:
    """Real text of about n_tokens, with FACT inserted between two lines when `fact`: (text,
    the fact line or None)."""
    from ktlong.bench import prose

    text = tokenizer.decode(prose.ids(tokenizer, n_tokens, seed=seed))  # whole sections, cut
    if not fact:
        return text, None
    rng = random.Random(seed)
    code = str(rng.randrange(10_000, 100_000))
    lines = text.split("\n")
    at = rng.randrange(1, max(2, len(lines)))
    lines.insert(at, FACT.format(code=code))
    return "\n".join(lines), lines[at]


def _questions(rng: random.Random, n: int, fact: bool) -> list[str]:
    qs = rng.sample(QUESTIONS, min(n, len(QUESTIONS)))
    return ([FACT_QUESTION] + qs[: n - 1]) if fact else qs


def examples_for(session: Any, rec: Recorder, conv: Conversation, questions: list[str],
                 answer_tokens: int, inv_freq: torch.Tensor | None) -> list[tuple[list, list]]:
    """Read the document once, then ask each question: per question, (features, labels) per
    store layer: `[n_prompt, F]` and `[n_prompt, Hkv]`."""
    from ktlong.engine import Sampling

    doc = conv.document_ids()
    rec.clear()
    rec.active = True
    session.prefill(doc)
    out = []
    for question in questions:
        ids = conv.prompt_ids(question)
        session.extend_to(ids)
        answer = [s.token_id for s in session.generate(Sampling(max_new_tokens=answer_tokens))]
        answer = [t for t in answer if t not in session.lm.eos_ids]
        if len(answer) >= 1:
            session.truncate(len(ids))
            session.prefill(answer)  # the answer's queries, as a chunk the recorder sees
            feats, labels = [], []
            for slot in range(len(rec.parts)):
                q, k, v = rec.take(slot, 0, len(ids) + len(answer))
                feats.append(locret.features(q[:, : len(ids)], k[:, : len(ids)],
                                             v[:, : len(ids)], 0, inv_freq))
                labels.append(locret.cis_labels(q, k, len(ids), rec.scale).T)
            out.append((feats, labels))
        session.truncate(len(doc))
    rec.active = False
    return out


def fact_span(conv_ids: list[int], plain_ids: list[int]) -> tuple[int, int]:
    """Token range of an inserted line: where the ids with it part from the ids without."""
    a = 0
    while a < min(len(conv_ids), len(plain_ids)) and conv_ids[a] == plain_ids[a]:
        a += 1
    b = 0
    while b < min(len(conv_ids), len(plain_ids)) - a and conv_ids[-1 - b] == plain_ids[-1 - b]:
        b += 1
    return a, len(conv_ids) - b


def fact_kept(session: Any, rec: Recorder, heads: Any, lm: Any, inv_freq: torch.Tensor | None,
              doc_tokens: int, docs: int = 4, keep: float = 0.25, seed: int = 0
              ) -> dict[str, float]:
    """The held-out check: documents no training run reads, each with a fact line; per store
    layer and KV head, the share of the line's tokens whose predicted score ranks in the
    document's top `keep` (a LOCRET budget of that share of the document). Returns the mean share
    and the share of layer-heads that rank >= 80% of the line there."""
    shares: list[torch.Tensor] = []
    for i in range(docs):
        text, line = _document(lm.tokenizer, doc_tokens, HELD_OUT0 + seed * 1000 + i, True)
        plain = text.replace(f"{line}\n", "", 1)
        ids = Conversation(lm.tokenizer, text).document_ids()
        a, b = fact_span(ids, Conversation(lm.tokenizer, plain).document_ids())
        rec.clear()
        rec.active = True
        session.prefill(ids)
        rec.active = False
        for slot in range(len(rec.parts)):
            q, k, v = rec.take(slot, 0, len(ids))
            with torch.no_grad():
                s = heads(slot, locret.features(q, k, v, 0, inv_freq))  # [n, Hkv]
            cut = torch.topk(s, max(1, int(keep * len(ids))), dim=0).values[-1]  # [Hkv]
            shares.append((s[a:b] >= cut).float().mean(0))  # [Hkv]
        session.truncate(0)
    rec.clear()
    every = torch.cat(shares)
    return {"fact_kept": float(every.mean()), "heads_keeping_fact": float((every >= 0.8).float()
                                                                         .mean())}


def train(lm: Any, out: Path, cfg: TrainConfig, fresh: bool = False,
          progress: Callable[[int, int, float], None] | None = None,
          threads: int = 0) -> dict[str, Any]:
    """Fit the heads of `lm` and save them to `out`; returns a summary (loss, time, size)."""
    from ktlong.engine import Session

    spec = lm.spec
    settings = dataclasses.replace(Settings(), attention="DENSE", prefill="DENSE",
                                   kv_type="FP32", threads_num=threads,
                                   max_seq_len=cfg.doc_tokens * 2 + 1024)
    session = Session(lm, settings)
    n_layers = session.store.shape.n_layers
    rec = Recorder(n_layers)
    session.router.evictor = rec
    rope = getattr(lm.model.model, "rotary_emb", None)
    inv = getattr(rope, "inv_freq", None)
    inv_freq = None if inv is None else inv.detach().double().cpu()
    n_in = (spec.n_heads + 2 * spec.n_kv_heads) * spec.head_dim
    heads = locret.RetainingHeads(n_layers, n_in, spec.n_kv_heads, cfg.hidden, seed=cfg.seed)
    opt = torch.optim.Adam(heads.parameters(), lr=cfg.lr)
    partial = out.with_name(out.name + ".partial")
    out.parent.mkdir(parents=True, exist_ok=True)
    done, losses, n_examples, t_used = 0, [], 0, 0.0
    if partial.is_file() and not fresh:
        try:
            ck = torch.load(partial, weights_only=False)
        except Exception:  # unreadable: start over (it is rewritten at the next checkpoint)
            ck = {}
        same = {**ck.get("config", {}), "docs": cfg.docs} == cfg.__dict__
        if ck.get("fingerprint") == spec.fingerprint and same and ck.get("done", 0) <= cfg.docs:
            heads.load_state_dict(ck["heads"])
            opt.load_state_dict(ck["opt"])
            done, losses, n_examples, t_used = ck["done"], ck["losses"], ck["examples"], ck["s"]
    t0 = time.perf_counter() - t_used
    rng = random.Random(cfg.seed)
    for _ in range(done):  # the same documents and questions as an unbroken run
        rng.random(), _questions(rng, cfg.questions, False)
    while done < cfg.docs:
        fact = rng.random() < 0.5
        questions = _questions(rng, cfg.questions, fact)
        text, _ = _document(lm.tokenizer, cfg.doc_tokens, SEED0 + cfg.seed * 10_000 + done, fact)
        exs = examples_for(session, rec, Conversation(lm.tokenizer, text), questions,
                           cfg.answer_tokens, inv_freq)
        session.truncate(0)
        for feats, labels in exs:
            opt.zero_grad()
            loss = sum(locret.head_loss(heads(i, f), y, cfg.alpha)
                       for i, (f, y) in enumerate(zip(feats, labels, strict=True))) / n_layers
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            n_examples += 1
        done += 1
        if done % cfg.save_every == 0 or done == cfg.docs:
            tmp = partial.with_name(partial.name + ".tmp")
            torch.save({"fingerprint": spec.fingerprint, "config": cfg.__dict__,
                        "heads": heads.state_dict(), "opt": opt.state_dict(), "done": done,
                        "losses": losses, "examples": n_examples,
                        "s": time.perf_counter() - t0}, tmp)
            tmp.replace(partial)
        if progress is not None:
            progress(done, cfg.docs, sum(losses[-8:]) / max(1, len(losses[-8:])))
    seconds = time.perf_counter() - t0
    check = fact_kept(session, rec, heads, lm, inv_freq, cfg.doc_tokens, seed=cfg.seed)
    meta = locret.HeadsMeta(spec.fingerprint, Path(spec.path).name, n_layers, n_in,
                            spec.n_kv_heads, cfg.hidden, len(losses), n_examples)
    locret.save_heads(out, heads, meta)
    partial.unlink(missing_ok=True)
    k = max(1, len(losses) // 10)
    return {"heads": str(out), "bytes": out.stat().st_size, "documents": done,
            "examples": n_examples, "seconds": seconds,
            "loss_first": sum(losses[:k]) / k, "loss_last": sum(losses[-k:]) / k, **check}


def main(model: Path, out: Path | None, cfg: TrainConfig, fresh: bool, threads: int,
         as_json: bool) -> dict[str, Any]:
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from ktlong import chatui, render
    from ktlong.model import load_model
    from ktlong.spec import read_spec

    spec = read_spec(model)
    if spec.sliding_layers:
        from ktlong.errors import KtlongError

        raise KtlongError(f"{Path(spec.path).name} has sliding-window layers (Gemma 3); "
                          "attention LOCRET does not read such models yet",
                          hint="train heads for a llama, qwen2, qwen3 or mistral model")
    ui = chatui.TerminalUI(as_json=as_json)
    with ui.loading(model):
        lm = load_model(model, "CPU")
    path = out or locret.heads_path(lm.spec)
    err = render.console(stderr=True)
    bar = Progress(TextColumn("training retaining heads"), BarColumn(bar_width=24),
                   TextColumn("{task.completed}/{task.total} documents  loss {task.fields[loss]}"),
                   TextColumn("ETA"), TimeRemainingColumn(), console=err, disable=as_json)
    with bar:
        task = bar.add_task("train", total=cfg.docs, loss="-")
        result = train(lm, path, cfg, fresh, threads=threads, progress=lambda d, n, loss:
                       bar.update(task, completed=d, loss=f"{loss:.4f}"))
    if as_json:
        render.print_json(result)
    else:
        err.print(f"{result['examples']} questions on {result['documents']} documents in "
                  f"{result['seconds'] / 60:.1f} min; loss {result['loss_first']:.4f} -> "
                  f"{result['loss_last']:.4f}")
        err.print(f"held-out fact lines: {result['fact_kept']:.0%} of their tokens rank in the "
                  f"top quarter of their document; {result['heads_keeping_fact']:.0%} of layer "
                  f"KV heads rank 80% of the line there")
        err.print(f"heads: {path} ({result['bytes'] / 2**20:.1f} MB); `--profile locret` uses them")
    return result
