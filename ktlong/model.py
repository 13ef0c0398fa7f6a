"""Model files: load a model through transformers, its weights kept as stored.

Two formats: a Hugging Face folder (config.json + *.safetensors) and a GGUF file, whose tensors
stay quantised in the memory-mapped file on the CPU (ktlong/ggufload.py). Both go through the same
transformers model classes; a model's shape comes from `ktlong.spec`, read without its weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ktlong.attention import ATTN_IMPLEMENTATION, register_attention
from ktlong.errors import KtlongError
from ktlong.spec import ModelSpec, open_gguf, read_spec


@dataclass
class LoadedModel:
    """A transformers model ready for ktlong's chunked prefill and sparse decode."""

    model: (
        Any  # a *ForCausalLM with `.model.layers`, `.model.norm`, `.model.rotary_emb`, `.lm_head`
    )
    tokenizer: Any
    spec: ModelSpec
    device: Any  # torch.device the weights live on
    eos_ids: tuple[int, ...]
    weight_type: str = ""  # what the linear layers hold: BF16 | FP16 | FP32 | GGUF <types>
    warnings: list[str] = field(default_factory=list)  # e.g. tensors widened on load


def _complete_gguf_tokenizer(tokenizer: Any, path: str) -> None:
    """Chat template and BOS/EOS/PAD from the GGUF's own metadata where transformers left
    them unset (a template's `{{ bos_token }}` would otherwise render as nothing)."""
    reader = open_gguf(path)
    field_ = reader.get_field("tokenizer.chat_template")
    if field_ is not None and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = field_.contents()
    tokens = reader.get_field("tokenizer.ggml.tokens")
    for attr, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("pad_token", "padding_token_id")):
        f = reader.get_field(f"tokenizer.ggml.{key}")
        if tokens is not None and f is not None and getattr(tokenizer, attr) is None:
            setattr(tokenizer, attr, tokens.contents(int(f.contents())))


def _gguf_converted(spec: ModelSpec, kw: dict[str, Any]) -> tuple[Any, Any]:
    """(config, tokenizer) for a GGUF file: transformers converts the file's metadata once, and
    ktlong keeps the result in KTLONG_HOME/gguf/<key> (config.json, tokenizer.json). Converting
    parses the whole header twice and builds the vocabulary in Python (Gemma 3's 262K entries:
    ~40 s, ~0.8 GB at its peak); the saved files load in ~3 s. The key is the file's fingerprint,
    its tokenizer's and transformers' version, so another file or converter never reads a stale
    one."""
    import hashlib

    import transformers
    from transformers import AutoConfig, AutoTokenizer

    from ktlong.config import ktlong_home

    key = hashlib.sha256(f"{spec.fingerprint} {spec.tokenizer_fingerprint} "
                         f"{transformers.__version__}".encode()).hexdigest()[:24]
    folder = ktlong_home() / "gguf" / key
    if (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file():
        try:
            config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
            tokenizer = _saved_tokenizer(folder)
            _complete_gguf_tokenizer(tokenizer, spec.path)
            return config, tokenizer
        except Exception:  # noqa: BLE001 - damaged (tokenizers raises its own kinds): convert
            pass  # again below and replace it
    where = str(Path(spec.path).parent)
    config = AutoConfig.from_pretrained(where, **kw)
    tokenizer = AutoTokenizer.from_pretrained(where, **kw)
    _complete_gguf_tokenizer(tokenizer, spec.path)
    if getattr(tokenizer, "is_fast", False):
        _save_atomically((config, tokenizer), folder)
    return config, tokenizer


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """A model's tokenizer without its weights (a GGUF's converted once, as `load_model` does)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub
    from transformers import AutoTokenizer

    spec = read_spec(path, need_weights=False)
    kw: dict[str, Any] = dict(local_files_only=True, trust_remote_code=False)
    try:
        if spec.format == "gguf":
            return _gguf_converted(spec, dict(kw, gguf_file=Path(spec.path).name))[1]
        return AutoTokenizer.from_pretrained(spec.path, **kw)
    except (OSError, ValueError) as e:
        raise KtlongError(f"could not load the tokenizer of {spec.path}: "
                          f"{str(e).splitlines()[0]}") from None


def _saved_tokenizer(folder: Path) -> Any:
    """A saved fast tokenizer read straight into the Rust library: `AutoTokenizer` would also
    parse the 33 MB tokenizer.json in Python (Gemma 3: +0.2 GB at the peak, +0.17 GB kept)."""
    import json

    from transformers import PreTrainedTokenizerFast

    meta = json.loads((folder / "tokenizer_config.json").read_text())
    special = {k: v if isinstance(v, str) else v["content"] for k, v in meta.items()
               if k.endswith("_token") and isinstance(v, (str, dict))}
    return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), **special)


def _save_atomically(objects: tuple[Any, ...], folder: Path) -> None:
    """Save each object (`save_pretrained`) into a fresh folder beside `folder`, then rename it
    into place: a reader sees the whole folder or none. A home that cannot be written is no
    error."""
    import shutil
    import tempfile

    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".part-", dir=folder.parent))
    except OSError:
        return
    try:
        for obj in objects:
            obj.save_pretrained(str(tmp))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def pick_device(name: str = "AUTO") -> Any:
    import torch

    name = name.upper()
    if name == "CUDA" and not torch.cuda.is_available():
        raise KtlongError(
            "device CUDA was asked for but no CUDA GPU is visible",
            hint="set device: AUTO or CPU, or install a CUDA build of torch",
        )
    if name == "CUDA" or (name == "AUTO" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def _stored_half(spec: ModelSpec, config: Any) -> str | None:
    """The 16-bit torch dtype that holds a checkpoint's weights (without loss where one can):
    float16 for F16 files, bfloat16 for BF16 and quantised ones; None when all are F32/F64.
    Pickle weights have no header to read: config.json's dtype says."""
    types = {t.upper() for t in spec.weight_types} - {"PICKLE"}
    if not types:
        own = str(getattr(config, "dtype", None) or "").removeprefix("torch.")
        return own if own in ("bfloat16", "float16") else None
    if types <= {"F32", "F64"}:
        return None
    return "float16" if types <= {"F32", "F64", "F16"} else "bfloat16"


HALF_TYPES = {"BF16": "bfloat16", "FP16": "float16", "FP32": None}  # weight_type -> torch dtype


def load_model(
    path: str | os.PathLike[str],
    device: str = "AUTO",
    dtype: str | None = None,
    allow_pickle: bool = False,
    weight_type: str = "AUTO",
) -> LoadedModel:
    """Load weights + tokenizer + chat template from an HF folder or a GGUF file.

    On CUDA, `dtype` (float32|bfloat16|float16) defaults to the checkpoint's own dtype for HF
    folders and to float32 for GGUF (transformers dequantises it). On the CPU, activations are
    `dtype` (default float32) and the linear layers and embedding keep 16-bit weights
    (ktlong.weights) per `weight_type`: AUTO keeps the checkpoint's 16-bit type (an FP32
    checkpoint stays FP32), BF16 / FP16 convert, FP32 widens.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    spec = read_spec(path)
    if "pickle" in spec.weight_types and not allow_pickle:
        raise KtlongError(
            f"{spec.path} holds pickle weights (*.bin), which can run code on load",
            hint="convert them to safetensors, or pass --allow-pickle if you trust them",
        )
    register_attention()
    dev = pick_device(device)
    kw: dict[str, Any] = dict(local_files_only=True, trust_remote_code=False)
    if spec.format == "gguf":
        folder, name = str(Path(spec.path).parent), Path(spec.path).name
        kw["gguf_file"] = name
        try:
            config, tokenizer = _gguf_converted(spec, kw)
        except (OSError, ValueError) as e:
            raise KtlongError(f"could not load {spec.path}: {str(e).splitlines()[0]}") from None
        _return_freed_heap()  # before the weights' pages come in: the conversion's garbage
        config.head_dim = spec.head_dim  # transformers drops `attention.key_length` for some archs
    else:
        folder = spec.path
        config = AutoConfig.from_pretrained(folder, **kw)
        kw["use_safetensors"] = not allow_pickle
    stored = _stored_half(spec, config)
    if dev.type == "cpu":
        half = stored if weight_type == "AUTO" else HALF_TYPES[weight_type]
        compute = getattr(torch, dtype or "float32")
        load_dtype = getattr(torch, stored) if half and stored else compute
    else:
        half = None
        default = "float32" if spec.format == "gguf" else stored or "float32"
        load_dtype = compute = getattr(torch, dtype or default)
    if (not spec.sliding_layers and getattr(config, "sliding_window", None)
            and getattr(config, "use_sliding_window", True)):
        config.sliding_window = None  # ktlong attends the whole context; the store has no window
    in_file = spec.format == "gguf" and dev.type == "cpu" and weight_type == "AUTO"
    warnings: list[str] = []
    try:
        if in_file:  # tensors stay quantised in the mapped file
            from ktlong.ggufload import load_quantised

            model, warnings = load_quantised(spec.path, config, compute, ATTN_IMPLEMENTATION)
            half = None
        else:
            model = AutoModelForCausalLM.from_pretrained(
                folder, config=config, dtype=load_dtype, attn_implementation=ATTN_IMPLEMENTATION,
                **kw)
        if spec.format != "gguf":
            tokenizer = AutoTokenizer.from_pretrained(folder, **kw)
    except (OSError, ValueError) as e:
        raise KtlongError(f"could not load {spec.path}: {str(e).splitlines()[0]}") from None
    model.eval().requires_grad_(False)
    if in_file:
        model.to(compute)  # norms and biases; the quantised tensors stay in the file
    elif half:
        from ktlong.weights import compact

        compact(model, getattr(torch, half), compute)
    else:
        model.to(dev, compute)
    if dev.type == "cpu":
        from ktlong.weights import gate_mlps_in_place

        gate_mlps_in_place(model)
    eos = getattr(model.generation_config, "eos_token_id", None) or config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids += (tokenizer.eos_token_id,)
    names = {torch.bfloat16: "BF16", torch.float16: "FP16", torch.float32: "FP32"}
    held = names.get(getattr(torch, half) if half else compute, str(compute))
    if in_file:
        held = _file_types(model)
    if spec.format == "gguf":
        _return_freed_heap()  # building the model around the file left float temporaries
    return LoadedModel(
        model=model, tokenizer=tokenizer, spec=spec, device=dev, eos_ids=eos_ids,
        weight_type=held, warnings=warnings,
    )


def _return_freed_heap() -> None:
    """Give the C heap's freed pages back to the OS (glibc's malloc_trim): parsing a file's
    metadata leaves many small objects freed but still resident. A no-op elsewhere."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _file_types(model: Any) -> str:
    """'GGUF Q4_K+Q6_K': the types the linear layers read from the file, most used first."""
    from ktlong.weights import QuantLinear

    count: dict[str, int] = {}
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            count[mod.qt.name] = count.get(mod.qt.name, 0) + 1
    return "GGUF " + "+".join(sorted(count, key=lambda t: -count[t]))
