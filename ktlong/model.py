"""Model files: read a model's shape without its weights, and load it through transformers.

Two formats: a Hugging Face folder (config.json + *.safetensors) and a GGUF file, whose tensors
stay quantised in the memory-mapped file on the CPU (ktlong/ggufload.py). Both go through the same
transformers model classes, so prefill and decode never need per-architecture code.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ktlong import quant
from ktlong.errors import KtlongError

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "mistral")
ATTN_IMPLEMENTATION = "ktlong"  # name registered with transformers' AttentionInterface

# GGUF tensor type names -> bytes per element is not needed: tensor byte sizes come from the reader.
_SAMPLE_BYTES = 4096
_SAMPLES_PER_FILE = 16


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a model, read from metadata alone."""

    path: str
    format: str  # "hf" | "gguf"
    arch: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_positions: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    weights_bytes: int  # once loaded on the CPU (a GGUF file's tensors as they are in the file)
    n_params: int
    weight_types: dict[str, int] = field(default_factory=dict)  # dtype / quant type -> tensor count
    has_chat_template: bool = False
    fingerprint: str = ""  # weights + config: changes when the numbers change
    tokenizer_fingerprint: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_spec(path: str | os.PathLike[str]) -> ModelSpec:
    """Read a model's shape from an HF folder or a GGUF file without reading tensor data."""
    p = Path(path).expanduser()
    if not p.exists():
        raise KtlongError(
            f"model path {p} does not exist",
            hint="pass --model with a Hugging Face folder or a .gguf file",
        )
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if not (p / "config.json").exists() and len(ggufs) == 1:
            return _read_gguf_spec(ggufs[0])
        return _read_hf_spec(p)
    if p.suffix.lower() == ".gguf":
        return _read_gguf_spec(p)
    raise KtlongError(
        f"{p} is not a model: expected a folder with config.json or a .gguf file",
        hint="pass --model with a Hugging Face folder or a .gguf file",
    )


def _check_arch(arch: str, where: Path) -> None:
    if arch not in SUPPORTED_ARCHS:
        raise KtlongError(
            f"{where}: architecture '{arch}' is not supported",
            hint=f"supported: {', '.join(SUPPORTED_ARCHS)}",
        )


def _safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise KtlongError(f"{path} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100_000_000:
            raise KtlongError(f"{path} is not a safetensors file (bad header length)")
        try:
            return json.loads(f.read(n))
        except ValueError as e:
            raise KtlongError(f"{path} has a damaged safetensors header: {e}") from None


def _file_fingerprint(h: hashlib._Hash, path: Path, header_len: int = 0) -> None:
    """Hash the size, the header and evenly spaced samples: cheap even for a 15 GB file."""
    size = path.stat().st_size
    h.update(path.name.encode() + str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(max(header_len, _SAMPLE_BYTES)))
        for i in range(1, _SAMPLES_PER_FILE + 1):
            f.seek(size * i // (_SAMPLES_PER_FILE + 1))
            h.update(f.read(_SAMPLE_BYTES))


def _tokenizer_fingerprint(folder: Path) -> str:
    h = hashlib.sha256()
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "vocab.json",
        "merges.txt",
        "special_tokens_map.json",
        "chat_template.jinja",
    ):
        f = folder / name
        if f.exists():
            h.update(name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def _read_hf_spec(folder: Path) -> ModelSpec:
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise KtlongError(
            f"{folder} is not a model folder: no config.json",
            hint="point --model at a Hugging Face model folder or a .gguf file",
        )
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise KtlongError(f"{cfg_path} is not valid JSON: {e}") from None
    arch = cfg.get("model_type", "")
    _check_arch(arch, folder)
    text_cfg = cfg.get("text_config", cfg)
    n_heads = int(text_cfg["num_attention_heads"])
    hidden = int(text_cfg["hidden_size"])
    head_dim = int(text_cfg.get("head_dim") or hidden // n_heads)

    weights = sorted(folder.glob("*.safetensors"))
    h = hashlib.sha256(cfg_path.read_bytes())
    types: dict[str, int] = {}
    n_bytes = n_params = 0
    for w in weights:
        header = _safetensors_header(w)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            types[info["dtype"]] = types.get(info["dtype"], 0) + 1
            start, end = info["data_offsets"]
            n_bytes += end - start
            count = 1
            for s in info["shape"]:
                count *= s
            n_params += count
        _file_fingerprint(h, w, header_len=8 + len(json.dumps(header)))
    if not weights:
        pickles = sorted(folder.glob("*.bin")) + sorted(folder.glob("*.pt"))
        if not pickles:
            raise KtlongError(f"{folder} has no weights (*.safetensors)")
        for w in pickles:
            n_bytes += w.stat().st_size
            _file_fingerprint(h, w)
        types["pickle"] = len(pickles)

    tok_cfg = folder / "tokenizer_config.json"
    has_template = (folder / "chat_template.jinja").exists() or (
        tok_cfg.exists() and "chat_template" in json.loads(tok_cfg.read_text() or "{}")
    )
    rope_scaling = text_cfg.get("rope_scaling")
    rope_theta = text_cfg.get("rope_theta")
    if rope_theta is None:  # transformers 5 keeps it in rope_parameters
        rope_theta = (text_cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        rp = text_cfg.get("rope_parameters") or {}
        if rp.get("rope_type", "default") != "default":
            rope_scaling = rp
    return ModelSpec(
        path=str(folder),
        format="hf",
        arch=arch,
        n_layers=int(text_cfg["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(text_cfg.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=int(text_cfg.get("intermediate_size", 0)),
        vocab_size=int(text_cfg["vocab_size"]),
        max_positions=int(text_cfg.get("max_position_embeddings", 0)),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        weights_bytes=n_bytes,
        n_params=n_params,
        weight_types=types,
        has_chat_template=has_template,
        fingerprint=h.hexdigest()[:16],
        tokenizer_fingerprint=_tokenizer_fingerprint(folder),
    )


def _gguf_value(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.get_field(key)
    if f is None:
        return default
    v = f.contents()
    return v


def _read_gguf_spec(path: Path) -> ModelSpec:
    import gguf  # light: numpy only

    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as e:  # the reader raises ValueError/struct errors on damaged files
        raise KtlongError(f"{path} is not a readable GGUF file: {e}") from None
    arch = _gguf_value(reader, "general.architecture", "")
    _check_arch(arch, path)

    def key(k: str, default: Any = None) -> Any:
        return _gguf_value(reader, f"{arch}.{k}", default)

    n_heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    head_dim = int(key("attention.key_length", hidden // n_heads))
    tokens = reader.get_field("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else 0
    types: dict[str, int] = {}
    n_bytes = n_params = 0
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        # what the loader holds: the file's bytes (memory-mapped), or BF16 for a type the
        # kernels do not read (widened on load)
        kept = t.tensor_type.name in quant.TYPES
        n_bytes += int(t.n_bytes) if kept else 2 * int(t.n_elements)
        n_params += int(t.n_elements)
    rope_scaling = None
    if key("rope.scaling.type") not in (None, "none"):
        rope_scaling = {"type": key("rope.scaling.type"), "factor": key("rope.scaling.factor")}

    h = hashlib.sha256()
    _file_fingerprint(
        h, path, header_len=int(reader.tensors[0].data_offset) if reader.tensors else 0
    )
    th = hashlib.sha256()
    for k in (
        "tokenizer.ggml.model",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "tokenizer.chat_template",
    ):
        f = reader.get_field(k)
        if f is not None:
            th.update(k.encode() + b"".join(bytes(p) for p in f.parts))
    return ModelSpec(
        path=str(path),
        format="gguf",
        arch=arch,
        n_layers=int(key("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(key("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length", 0)),
        vocab_size=vocab,
        max_positions=int(key("context_length", 0)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        weights_bytes=n_bytes,
        n_params=n_params,
        weight_types=types,
        has_chat_template=reader.get_field("tokenizer.chat_template") is not None,
        fingerprint=h.hexdigest()[:16],
        tokenizer_fingerprint=th.hexdigest()[:16],
    )


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
    import gguf

    reader = gguf.GGUFReader(path, "r")
    field_ = reader.get_field("tokenizer.chat_template")
    if field_ is not None and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = field_.contents()
    tokens = reader.get_field("tokenizer.ggml.tokens")
    for attr, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("pad_token", "padding_token_id")):
        f = reader.get_field(f"tokenizer.ggml.{key}")
        if tokens is not None and f is not None and getattr(tokenizer, attr) is None:
            setattr(tokenizer, attr, tokens.contents(int(f.contents())))


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

    from ktlong.attention import register_attention

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
        config = AutoConfig.from_pretrained(folder, **kw)
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
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
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
        tokenizer = AutoTokenizer.from_pretrained(folder, **kw)
    except (OSError, ValueError) as e:
        raise KtlongError(f"could not load {spec.path}: {str(e).splitlines()[0]}") from None
    if spec.format == "gguf":
        _complete_gguf_tokenizer(tokenizer, spec.path)
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
    return LoadedModel(
        model=model, tokenizer=tokenizer, spec=spec, device=dev, eos_ids=eos_ids,
        weight_type=held, warnings=warnings,
    )


def _file_types(model: Any) -> str:
    """'GGUF Q4_K+Q6_K': the types the linear layers read from the file, most used first."""
    from ktlong.weights import QuantLinear

    count: dict[str, int] = {}
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            count[mod.qt.name] = count.get(mod.qt.name, 0) + 1
    return "GGUF " + "+".join(sorted(count, key=lambda t: -count[t]))
