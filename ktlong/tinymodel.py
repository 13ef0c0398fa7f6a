"""Build small random models in users' formats (HF folder, GGUF file) for tests and benchmarks.

Nothing is downloaded: the byte-level BPE tokenizer is trained here on generated text, and the
weights are random. The GGUF writer applies llama.cpp's Q/K row permutation for llama-family
tensors, which transformers undoes on load; without it a GGUF model is silently wrong.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np

from ktlong import quant

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_WORDS = (
    "the a of and to in is was that for on with as by at from it this be are or an have not "
    "which one all were when there can more if out so what up about into them than then its "
    "river stone garden letter number key value pass needle hidden record city north south "
    "morning evening winter summer silver copper lantern harbour meadow quiet bright"
).split()


def filler_text(n_words: int, seed: int = 0) -> str:
    """Plain prose-like filler of `n_words` words, reproducible from `seed`."""
    rng = random.Random(seed)
    out, sentence = [], 0
    for _ in range(n_words):
        w = rng.choice(_WORDS)
        out.append(w.capitalize() if sentence == 0 else w)
        sentence += 1
        if sentence > rng.randint(6, 14):
            out[-1] += "."
            sentence = 0
    return " ".join(out)


def build_tokenizer(vocab_size: int = 512) -> Any:
    """A byte-level BPE tokenizer (GPT-2 style) with chat special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [filler_text(200, seed=i) + " 0123456789 key: value, pass?" for i in range(50)]
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|eos|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_config(
    arch: str = "llama",
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate: int | None = None,
    vocab: int = 512,
    max_positions: int = 131072,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    tie_embeddings: bool = False,
    sliding_window: int | None = None,
) -> Any:
    """A transformers config for one of the supported architectures (gemma3_text: its sliding
    window, when given, in place of the default 4096)."""
    from transformers import AutoConfig

    kw: dict[str, Any] = dict(
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim or hidden // heads,
        vocab_size=vocab,
        max_position_embeddings=max_positions,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=tie_embeddings,
    )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling:
        rope.update(rope_scaling)
    kw["rope_parameters"] = rope
    if arch == "mistral":
        kw["sliding_window"] = None
    if arch == "gemma3_text" and sliding_window:
        kw["sliding_window"] = sliding_window
    return AutoConfig.for_model(arch, **kw)


def make_model(
    out_dir: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    dtype: str = "float32",
    qk_scale: float = 1.0,
    **config_kw: Any,
) -> Path:
    """Write a random model + tokenizer as an HF folder; returns the folder.

    `qk_scale` multiplies the q/k projections so attention is peaked rather than flat.
    """
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(config_kw.get("vocab", 512))
    config_kw["vocab"] = len(tok)
    cfg = make_config(arch, **config_kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(qk_scale)
    model.to(getattr(torch, dtype)).save_pretrained(out)
    tok.save_pretrained(out)
    return out


_GGUF_ARCH = {"llama": "LLAMA", "mistral": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3"}


def _permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's row order for rotary halves: [n_head, 2, dim/2, ...] -> [n_head, dim/2, 2, ...]
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(hf_dir: str | Path, out_file: str | Path, tensor_type: str = "F32") -> Path:
    """Export an HF folder written by `make_model` to one GGUF file.

    `tensor_type` is F32, F16, BF16 or a type ktlong.quant quantises (Q8_0, Q4_0, Q4_1, Q5_0,
    Q5_1, Q4_K, Q5_K, Q6_K) for the 2-D weights; norms stay F32.
    """
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    hf_dir, out_file = Path(hf_dir), Path(out_file)
    cfg = AutoConfig.from_pretrained(hf_dir)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    arch = gguf.MODEL_ARCH[_GGUF_ARCH[cfg.model_type]]
    w = gguf.GGUFWriter(str(out_file), gguf.MODEL_ARCH_NAMES[arch])
    gguf_header(w, cfg, tok)

    qtype = gguf.GGMLQuantizationType[tensor_type]
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    state: dict[str, Any] = {}  # name -> torch tensor (BF16 has no NumPy dtype)
    for f in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(f))
    permute = cfg.model_type in ("llama", "mistral")
    for hf_name, t in state.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        t = t.float().numpy()
        if permute and hf_name.endswith("q_proj.weight"):
            t = _permute_qk(t, cfg.num_attention_heads)
        elif permute and hf_name.endswith("k_proj.weight"):
            t = _permute_qk(t, cfg.num_key_value_heads)
        if t.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, t)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, t.astype(np.float16))
        else:
            q = quant.quantize(t, tensor_type)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_file


def gguf_header(w: Any, cfg: Any, tok: Any, vocab: int | None = None) -> None:
    """Write a llama-family config and the byte-level BPE tokenizer `tok` into GGUF writer `w`;
    the token list is padded with reserved control tokens up to `vocab` (default: tok's)."""
    import gguf

    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_vocab_size(vocab or cfg.vocab_size)

    # tokenizer: byte-level BPE ("gpt2" in GGUF terms), with control tokens and the template
    tokens = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    special = set(tok.all_special_tokens) | set(SPECIAL_TOKENS)
    types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    pad = (vocab or len(tokens)) - len(tokens)
    tokens += [f"<|reserved_{i}|>" for i in range(pad)]
    types += [gguf.TokenType.CONTROL] * pad
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges(_bpe_merges(tok))
    w.add_token_types(types)
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_add_bos_token(False)
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)


def _bpe_merges(tok: Any) -> list[str]:
    import json

    model = json.loads(tok.backend_tokenizer.to_str())["model"]
    return [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
