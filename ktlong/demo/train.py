"""Train the built-in demo model: `python -m ktlong.demo.train --seed 0 [--out DIR]`.

A small Llama (GQA: 4 query heads, 2 KV heads) learns to answer questions about facts hidden in
filler documents (ktlong.demo.tasks), with the loss on the answers (plus a 0.2-weight next-token
loss on the rest). Retrieval is learned by curriculum (STAGES): training starts on tiny documents
(12-24 tokens) holding one number and a few questions, so most tokens of a batch are facts,
questions and answers (hundreds of answer tokens per step) and attention has few places to look;
then distractor numbers and filler are added, stage by stage, up to 1024-token documents. A stage
ends when held-out answer-value accuracy at that stage reaches ADVANCE_ACC, or after STAGE_CAP
steps; one batch in five revisits an earlier stage.

After `--steps` curriculum steps, a long phase (`--long-steps`, at `--long-lr`) trains on single
documents of 1K-16K tokens (LONG_LENGTHS): the curriculum alone leaves the heads that read the
question and the fact diluted past ~8K tokens (0% pass key at 16K); a 16K-token attention set is
what a default-profile decode step reads at any document length.

Length generalisation also comes from the position ids: documents of JUMP_FROM tokens or more
often get "position jumps" at a few sentence boundaries, so the distance between a fact and its
question ranges up to 1M positions while every sentence, the question and the answer stay
contiguous (local order is never disturbed, unlike fully random position ids). RoPE base 1e6
keeps low-frequency channels nearly still over those distances.

Reproducible from `--seed`: data comes from per-sample seeds and the step count is fixed; the stage
switches depend on measured accuracy, so use the same `--threads` to reproduce a run bit for bit.
Checkpoints (`--work DIR/ckpt.pt`) are written every `--save-every` steps; `--resume` continues one.
The result is exported as an HF folder (fp16 safetensors, tokenizer, chat template) + a GGUF file.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import torch

from ktlong.conversation import Conversation, Turn
from ktlong.demo import MODEL_DIR, tasks

GGUF_NAME = "ktlong-demo.gguf"
SPECIAL = ["<|bos|>", "<|end|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CONFIG = dict(hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, intermediate=384,
              rope_theta=1e6, max_positions=1 << 20)
# Curriculum stages (max document tokens, max numbers in a document): retrieval is learned first
# on tiny documents holding one number (pure copying), then distractors and filler are added. A
# stage ends when the held-out answer-value accuracy at that stage reaches ADVANCE_ACC (measured
# every EVAL_EVERY steps), so length grows once retrieval works at the shorter length, or after
# STAGE_CAP steps (so every stage is reached within the step budget).
STAGES = ((24, 1), (32, 2), (48, 3), (64, 5), (96, 8), (160, 10), (256, 12), (512, 12),
          (1024, 12))
# Long phase, after the curriculum: documents of 1K-16K tokens (one a batch), so heads learn to
# find the question and the fact among as many tokens as a sparse decode step reads (~16.5K with
# the default profile); the curriculum alone (<= 1K) leaves them diluted past ~8K.
LONG_LENGTHS = (1024, 2048, 4096, 8192, 16384)
# Numbers in a long-phase document: up to one per LONG_NUMBER_TOKENS tokens, at least 24 and at
# most 90 (one key of tasks.KEYS is left for the pass key): 90 at 16K. A decode step at 64K reads
# the ~16.5K tokens whose blocks look most like the question, so it sees more numbers than a 16K
# document holds; with 24 at most the model copied the wrong digits there (docs/benchmarks.md).
LONG_NUMBERS = 24
LONG_NUMBER_TOKENS = 128
LONG_BATCH_TOKENS = 4096  # a long-phase batch: one document, or as many 1K ones as fit
JUMP_FROM = 256  # documents this long or longer get position jumps (length generalisation)
ADVANCE_ACC = 0.7
STAGE_CAP = 500
EVAL_EVERY = 50
REPEAT_P = 0.15  # filler sentences that repeat an earlier one: dense copy signal for the LM loss
LM_WEIGHT = 0.2  # next-token loss on every other token, beside the answers' (weight 1)
BATCH_TOKENS = 2048


# --- tokenizer -----------------------------------------------------------------------------------
def build_tokenizer(vocab_size: int = 1280) -> Any:
    """Byte-level BPE over the task vocabulary; digits are always single tokens (copying)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    rng = random.Random(1234)
    corpus = [" ".join(tasks.filler_sentence(rng) for _ in range(20)) for _ in range(300)]
    words = tasks.FILLER + tasks.KEYS + tasks.CITIES + list(tasks.VERBS)
    corpus += [" ".join(w.capitalize() if i % 2 else w for i, w in enumerate(words))] * 20
    for i in range(400):
        s = tasks.make_sample(i, 0)
        corpus += [f.sentence + " " + f.question + " " + f.answer for f in s.facts]
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|end|>",
                                   pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_model(tok: Any, seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    c = CONFIG
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=c["hidden"], intermediate_size=c["intermediate"],
        num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
        num_key_value_heads=c["kv_heads"], head_dim=c["head_dim"],
        max_position_embeddings=c["max_positions"], rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"]},
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    return model


# --- data ----------------------------------------------------------------------------------------
def encode(tok: Any, sample: tasks.Sample) -> tuple[list[int], list[int], int]:
    """(ids, loss mask, document prefix length) rendered exactly as `ktlong chat` renders them."""
    conv = Conversation(tok, sample.document)
    ids: list[int] = []
    mask: list[int] = []
    end = tok.convert_tokens_to_ids("<|end|>")
    for f in sample.asked:
        p = conv.prompt_ids(f.question)
        assert p[: len(ids)] == ids, "chat template is not prefix-stable"
        ans = tok(f.answer, add_special_tokens=False)["input_ids"]
        mask += [0] * (len(p) - len(ids)) + [1] * (len(ans) + 1)
        ids = p + ans + [end]
        conv.turns.append(Turn(f.question, ans, f.answer))
    return ids, mask, len(conv.document_ids())


def position_ids(rng: random.Random, tok: Any, sample: tasks.Sample, n: int, doc_len: int,
                 jump_p: float = 0.7, max_span: float = 1e6) -> list[int]:
    """0..n-1, plus jumps at a few filler sentence starts (never inside or next to a fact)."""
    pos = list(range(n))
    if rng.random() > jump_p:
        return pos
    head = Conversation(tok, "").document_ids()
    doc = sample.document
    guard = []
    for f in sample.facts:
        at = doc.find(f.sentence)
        guard.append((at - 2, at + len(f.sentence) + 2))
    starts = [i + 1 for i, ch in enumerate(doc) if ch in " \n" and i > 0 and doc[i - 1] == "."]
    starts = [c for c in starts if not any(a <= c <= b for a, b in guard)]
    if not starts:
        return pos
    enc = tok(tok.decode(head) + doc, add_special_tokens=False, return_offsets_mapping=True)
    shift = len(tok.decode(head))
    offs = [o[0] - shift for o in enc["offset_mapping"]]
    k = rng.randint(1, 8)
    cuts = sorted(rng.sample(starts, min(k, len(starts))))
    span = math.exp(rng.uniform(math.log(1e3), math.log(max_span)))
    w = [rng.expovariate(1.0) for _ in cuts]
    gaps = [int(span * x / sum(w)) for x in w]
    import bisect

    extra, j = 0, 0
    tok_cuts = [min(bisect.bisect_left(offs, c - 1), doc_len - 1) for c in cuts]
    for i in range(n):
        while j < len(tok_cuts) and tok_cuts[j] <= i:
            extra += gaps[j]
            j += 1
        pos[i] += extra
    return pos


def dense_sample(seed: int, n_tokens: int, max_numbers: int,
                 repeat_p: float = 0.0) -> tasks.Sample:
    """A training document dense in facts: up to `max_numbers` numbers (a pass key and/or kv
    records), 0-2 needles, and up to 4 questions; `n_tokens` is small at the start."""
    rng = random.Random(seed)
    n_num = rng.randint(1, max_numbers)
    facts: list[tasks.Fact] = []
    asked: list[tasks.Fact] = []
    if rng.random() < (0.5 if n_num == 1 else 0.7):
        f = tasks.passkey_fact(rng, rng.random())
        facts.append(f)
        asked.append(f)
        n_num -= 1
    recs = [tasks.kv_fact(rng, rng.random(), k) for k in rng.sample(tasks.KEYS, n_num)]
    facts += recs
    if recs:
        asked += rng.sample(recs, rng.randint(1, min(3, len(recs))))
    if rng.random() < 0.4:
        needles = [tasks.needle_fact(rng, rng.random(), c)
                   for c in rng.sample(tasks.CITIES, rng.randint(1, 2))]
        facts += needles
        asked.append(rng.choice(needles))
    rng.shuffle(asked)
    facts.sort(key=lambda f: f.depth)
    return tasks.Sample(tasks._fill(rng, facts, n_tokens, None, repeat_p), facts, asked)


def collate(tok: Any, rows: list[tuple[list[int], list[int], list[int]]],
            ) -> tuple[torch.Tensor, ...]:
    n = max(len(r[0]) for r in rows)
    pad = tok.pad_token_id
    ids = torch.tensor([r[0] + [pad] * (n - len(r[0])) for r in rows])
    mask = torch.tensor([r[1] + [0] * (n - len(r[1])) for r in rows])
    pos = torch.tensor([r[2] + list(range(r[2][-1] + 1, r[2][-1] + 1 + n - len(r[2])))
                        for r in rows])
    return ids, mask, pos  # right padding: causal attention never sees it


def make_batch(tok: Any, seed: int, step: int, stage: int,
               jump_p: float = 0.6) -> tuple[torch.Tensor, ...]:
    """One batch at curriculum `stage` (1 batch in 5 revisits an earlier stage); lengths between
    half the stage's maximum and the maximum, one length per batch."""
    rng = random.Random(seed * 1_000_003 + step)
    if stage and rng.random() < 0.2:
        stage = rng.randrange(stage)
    max_len, max_num = STAGES[stage]
    length = rng.randint(max_len // 2, max_len)
    jp = jump_p if length >= JUMP_FROM else 0.0
    per = max(1, BATCH_TOKENS // (length + 60))
    rows = []
    for _ in range(per):
        s = dense_sample(rng.randrange(2**31), length, max_num, repeat_p=REPEAT_P)
        ids, mask, doc_len = encode(tok, s)
        rows.append((ids, mask, position_ids(rng, tok, s, len(ids), doc_len, jp)))
    return collate(tok, rows)


def long_numbers(length: int) -> int:
    """Most numbers a long-phase document of `length` tokens holds."""
    return min(len(tasks.KEYS) - 1, max(LONG_NUMBERS, length // LONG_NUMBER_TOKENS))


def make_long_batch(tok: Any, seed: int, step: int, jump_p: float = 0.6,
                    ) -> tuple[torch.Tensor, ...]:
    """One long-phase batch: documents of one of LONG_LENGTHS tokens, LONG_BATCH_TOKENS at most
    (at least one)."""
    rng = random.Random(seed * 2_000_003 + step)
    length = rng.choice(LONG_LENGTHS)
    rows = []
    for _ in range(max(1, LONG_BATCH_TOKENS // (length + 60))):
        s = dense_sample(rng.randrange(2**31), length, long_numbers(length), repeat_p=REPEAT_P)
        ids, mask, doc_len = encode(tok, s)
        rows.append((ids, mask, position_ids(rng, tok, s, len(ids), doc_len, jump_p)))
    return collate(tok, rows)


def loss_fn(model: Any, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor,
            pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Answer tokens weigh 1, every other real token LM_WEIGHT (induction heads form sooner)."""
    h = model.model(input_ids=ids, position_ids=pos).last_hidden_state  # [B, n, hidden]
    logits = model.lm_head(h[:, :-1])  # [B, n-1, vocab]
    nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten(),
                                            reduction="none").view(ids.shape[0], -1)
    ans = mask[:, 1:].float()
    rest = (ids[:, 1:] != pad).float() * (1 - ans)
    ans_loss = (nll * ans).sum() / ans.sum()
    lm_loss = (nll * rest).sum() / rest.sum().clamp(min=1)
    return ans_loss, lm_loss


def _value_rows(tok: Any, sample: tasks.Sample) -> list[tuple]:
    """(ids, value mask, positions) per asked fact, each as the first question after the
    document (as `bench accuracy` asks); the mask marks the tokens of the value only."""
    conv = Conversation(tok, sample.document)
    end = tok.convert_tokens_to_ids("<|end|>")
    rows = []
    for f in sample.asked:
        p = conv.prompt_ids(f.question)
        pre = f.answer[: f.answer.index(f.value)]
        n_pre = len(tok(pre, add_special_tokens=False)["input_ids"])
        ans = tok(f.answer, add_special_tokens=False)["input_ids"]
        n_val = len(tok(pre + f.value, add_special_tokens=False)["input_ids"]) - n_pre
        vm = [0] * n_pre + [1] * n_val + [0] * (len(ans) - n_pre - n_val)
        ids = p + ans + [end]
        rows.append((ids, [0] * len(p) + vm + [0], list(range(len(ids)))))
    return rows


@torch.no_grad()
def value_accuracy(model: Any, tok: Any, samples: list[tasks.Sample]) -> float:
    """Share of answer-value tokens (digits, needle words) predicted right, teacher forcing."""
    model.eval()
    rows = [r for s in samples for r in _value_rows(tok, s)]
    right = total = 0
    per = max(1, 8192 // max(len(r[0]) for r in rows))
    for b in range(0, len(rows), per):
        ids, mask, pos = collate(tok, rows[b:b + per])
        h = model.model(input_ids=ids, position_ids=pos).last_hidden_state
        sel = mask[:, 1:].bool()
        pred = model.lm_head(h[:, :-1][sel]).argmax(-1)
        right += int((pred == ids[:, 1:][sel]).sum())
        total += int(sel.sum())
    model.train()
    return right / max(total, 1)


def stage_eval(model: Any, tok: Any, stage: int, n: int = 24, seed: int = 99) -> float:
    """Held-out value accuracy on documents of the stage's maximum length and numbers."""
    max_len, max_num = STAGES[stage]
    return value_accuracy(model, tok, [dense_sample(seed * 7919 + i, max_len, max_num)
                                       for i in range(n)])


def quick_eval(model: Any, tok: Any, n: int = 8, length: int = 1024, seed: int = 99) -> float:
    """Value accuracy on `bench accuracy`-style documents (pass key, 4 kv records, a needle)."""
    depths = {t: (0.2 + j / 3) % 1.0 for j, t in enumerate(tasks.TASKS)}
    return value_accuracy(model, tok, [tasks.make_mixed(seed * 7919 + length + i, length, depths)
                                       for i in range(n)])


# --- export --------------------------------------------------------------------------------------
def export(model: Any, tok: Any, out: Path, gguf: bool = True) -> None:
    """HF folder with fp16 weights (config says float32: ktlong computes in fp32 on CPU)."""
    import copy

    out.mkdir(parents=True, exist_ok=True)
    m = copy.deepcopy(model).to(torch.float16)
    m.generation_config.eos_token_id = [tok.eos_token_id]
    m.generation_config.bos_token_id = tok.bos_token_id
    m.generation_config.pad_token_id = tok.pad_token_id
    m.save_pretrained(out)
    tok.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    if gguf:
        from ktlong.tinymodel import write_gguf

        write_gguf(out, out / GGUF_NAME, "F16")


# --- main ----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--long-steps", type=int, default=400)
    ap.add_argument("--long-lr", type=float, default=5e-4)
    ap.add_argument("--threads", type=int, default=1)  # the shipped model: 1 thread
    ap.add_argument("--work", type=Path, default=Path("demo-train"))
    ap.add_argument("--out", type=Path, default=MODEL_DIR)
    ap.add_argument("--save-every", type=int, default=250)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--stop-after", type=int, default=0,
                    help="stop (and export) after this many steps; the schedule keeps --steps")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    a.work.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    model = make_model(tok, a.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.05)
    warm = min(50, a.steps // 10)

    def lr_at(step: int) -> float:
        if step >= a.steps:  # long phase: short warm-up, then cosine down to 10%
            i = step - a.steps
            t = i / max(1, a.long_steps)
            warm_long = min(1.0, (i + 1) / 20)
            return a.long_lr * warm_long * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))
        if step < warm:
            return a.lr * (step + 1) / warm
        t = max(0.0, (step - 0.7 * a.steps) / (0.3 * a.steps))  # stable, then decay
        return a.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))

    start, spent, stage, since = 0, 0.0, 0, 0
    ckpt = a.work / "ckpt.pt"
    if a.resume and ckpt.exists():
        st = torch.load(ckpt, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        start, spent, stage, since = st["step"], st["spent"], st["stage"], st["since"]
        print(f"resumed at step {start}, stage {stage}", flush=True)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params / 1e6:.2f}M vocab {len(tok)} steps {a.steps}", flush=True)
    model.train()
    t0, ema = time.time() - spent, None
    total = a.steps + a.long_steps
    end = min(total, a.stop_after or total)
    for step in range(start, end):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        long = step >= a.steps
        ids, mask, pos = (make_long_batch(tok, a.seed, step) if long
                          else make_batch(tok, a.seed, step, stage))
        loss, lm_loss = loss_fn(model, ids, mask, pos, tok.pad_token_id)
        opt.zero_grad(set_to_none=True)
        (loss + LM_WEIGHT * lm_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lv = float(loss.detach())
        ema = lv if ema is None else 0.95 * ema + 0.05 * lv
        if step % 20 == 0:
            print(f"step {step} stage {stage} len {ids.shape[1]} loss {lv:.3f} ema {ema:.3f} "
                  f"lm {float(lm_loss.detach()):.2f} "
                  f"lr {lr_at(step):.2e} t {time.time() - t0:.0f}s", flush=True)
        if (step + 1) % EVAL_EVERY == 0 and not long:
            acc = stage_eval(model, tok, stage)
            print(f"eval step {step + 1} stage {stage} {STAGES[stage]} value acc {acc:.3f} "
                  f"t {time.time() - t0:.0f}s", flush=True)
            done = acc >= ADVANCE_ACC or step + 1 - since >= STAGE_CAP
            if done and stage + 1 < len(STAGES):
                stage, since = stage + 1, step + 1
                print(f"advance to stage {stage} {STAGES[stage]}", flush=True)
        if (step + 1) % a.save_every == 0 or step + 1 == end:
            for n_tok in (256, 1024) + ((4096, 16384) if long else ()):
                print(f"eval step {step + 1} bench-style {n_tok} tokens value acc "
                      f"{quick_eval(model, tok, length=n_tok):.3f}", flush=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1,
                        "spent": time.time() - t0, "stage": stage, "since": since},
                       a.work / "ckpt.tmp")
            (a.work / "ckpt.tmp").replace(ckpt)
            export(model, tok, a.work / "latest", gguf=False)
    export(model, tok, a.out)
    print(f"done in {time.time() - t0:.0f}s; model in {a.out}", flush=True)


if __name__ == "__main__":
    main()
