"""A model's shape, read from its files' metadata alone (no weights): `ModelSpec` and
`read_spec` for a Hugging Face folder (config.json + safetensors headers) or a GGUF file (its
header, through `open_gguf`, which explains a damaged or truncated file in one line).

What sits where: this module knows shapes; `ktlong.ggufload` reads a GGUF file's tensors;
`ktlong.model` loads a model (weights, tokenizer) through both; `ktlong.attention` is the glue
transformers calls. Each imports only the ones before it.
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

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma3")
_HF_ARCHS = {"gemma3_text": "gemma3"}  # config.json model_type -> arch, where they differ
GEMMA3_SWA_PATTERN = 6  # Gemma 3: five sliding-window layers, then one global

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
    weights_estimated: bool = False  # an HF folder without weights: sizes from config.json
    sliding_window: int = 0  # tokens a sliding-window layer reads (its own included)
    sliding_layers: tuple[int, ...] = ()  # layers that read only the last sliding_window tokens
    rope_local_theta: float = 0.0  # RoPE base of the sliding-window layers (0: rope_theta)

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers whose KV grows with the context (all but the sliding-window ones): the KV
        store, block selection and the prompt cache cover these."""
        return tuple(i for i in range(self.n_layers) if i not in self.sliding_layers)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# RoPE extensions that stretch positions past the length the model was trained at (llama3's is
# not one: Llama 3.1 was trained at its full max positions)
_STRETCHED_ROPE = ("yarn", "linear", "dynamic", "longrope")


def trained_context(spec: Any) -> int:
    """The longest distance the model was trained on (0: unknown): its max positions, or the
    original length under a YaRN / linear / dynamic / LongRoPE extension that names one."""
    n = int(getattr(spec, "max_positions", 0) or 0)
    scaling = getattr(spec, "rope_scaling", None) or {}
    kind = str(scaling.get("rope_type") or scaling.get("type") or "").lower()
    original = int(scaling.get("original_max_position_embeddings")
                   or scaling.get("original_context_length") or 0)
    if kind in _STRETCHED_ROPE and original > 0:
        return min(n, original) if n > 0 else original
    return n


def read_spec(path: str | os.PathLike[str], need_weights: bool = True) -> ModelSpec:
    """Read a model's shape from an HF folder or a GGUF file without reading tensor data.

    An HF folder without weight files is refused unless `need_weights` is False (memcheck,
    inspect model): then the parameter count and size are estimated from config.json.
    """
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
        return _read_hf_spec(p, need_weights)
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


_DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


def _config_params(cfg: dict[str, Any], arch: str, head_dim: int) -> int:
    """Parameters of a llama-family model from its config alone (what its safetensors hold)."""
    hidden, vocab = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    n_heads = int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads") or n_heads)
    inter = int(cfg.get("intermediate_size", 0))
    q, kv = n_heads * head_dim, n_kv * head_dim
    layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter + 2 * hidden  # + 2 norms
    if arch == "qwen2" or cfg.get("attention_bias"):
        layer += q + 2 * kv + (hidden if cfg.get("attention_bias") else 0)
    if cfg.get("mlp_bias"):
        layer += 2 * inter + hidden
    if arch == "qwen3":
        layer += 2 * head_dim  # q_norm, k_norm
    embed = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    return int(cfg["num_hidden_layers"]) * layer + embed + hidden  # + the final norm


def _read_hf_spec(folder: Path, need_weights: bool = True) -> ModelSpec:
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
    arch = _HF_ARCHS.get(cfg.get("model_type", ""), cfg.get("model_type", ""))
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
    pickles = [] if weights else sorted(folder.glob("*.bin")) + sorted(folder.glob("*.pt"))
    for w in pickles:
        n_bytes += w.stat().st_size
        _file_fingerprint(h, w)
    if pickles:
        types["pickle"] = len(pickles)
    estimated = not weights and not pickles
    if estimated and need_weights:
        raise KtlongError(
            f"{folder} has no weights: config.json but no *.safetensors files",
            hint="download the model's *.safetensors files into it (`ktlong memcheck` and "
                 "`ktlong inspect model` work without them)",
        )
    if estimated:  # metadata only: size from the config's shape and dtype
        n_params = _config_params(text_cfg, arch, head_dim)
        dtype = str(text_cfg.get("torch_dtype") or text_cfg.get("dtype")
                    or cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        n_bytes = n_params * _DTYPE_BYTES.get(dtype.removeprefix("torch."), 2)

    tok_cfg = folder / "tokenizer_config.json"
    has_template = (folder / "chat_template.jinja").exists() or (
        tok_cfg.exists() and "chat_template" in json.loads(tok_cfg.read_text() or "{}")
    )
    rope_scaling = text_cfg.get("rope_scaling")
    rope_theta = text_cfg.get("rope_theta")
    rp = text_cfg.get("rope_parameters") or {}
    local_theta = float(text_cfg.get("rope_local_base_freq") or 0.0)
    if "full_attention" in rp:  # per layer type (Gemma 3)
        local_theta = float((rp.get("sliding_attention") or {}).get("rope_theta", local_theta))
        rp = rp["full_attention"]
    if rope_theta is None:  # transformers 5 keeps it in rope_parameters
        rope_theta = rp.get("rope_theta", 10000.0)
        if rp.get("rope_type", "default") != "default":
            rope_scaling = rp
    n_layers = int(text_cfg["num_hidden_layers"])
    window, sliding = _hf_sliding(text_cfg, arch, n_layers)
    return ModelSpec(
        path=str(folder),
        format="hf",
        arch=arch,
        n_layers=n_layers,
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
        weights_estimated=estimated,
        sliding_window=window,
        sliding_layers=sliding,
        rope_local_theta=local_theta if sliding else 0.0,
    )


def _hf_sliding(cfg: dict[str, Any], arch: str, n_layers: int) -> tuple[int, tuple[int, ...]]:
    """(window, sliding-window layers) from a config: Gemma 3's `layer_types` (or its pattern).
    Other architectures' `sliding_window` is ignored: ktlong reads their whole context."""
    window = int(cfg.get("sliding_window") or 0)
    if arch != "gemma3" or window <= 0:
        return 0, ()
    types = cfg.get("layer_types")
    if types:
        return window, tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    pattern = int(cfg.get("sliding_window_pattern") or GEMMA3_SWA_PATTERN)
    return window, _swa_pattern(n_layers, pattern)


def _swa_pattern(n_layers: int, pattern: int) -> tuple[int, ...]:
    """Every `pattern`-th layer global, the others sliding (llama.cpp's set_swa_pattern)."""
    return tuple(i for i in range(n_layers) if i % pattern < pattern - 1)


def _gguf_value(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.get_field(key)
    if f is None:
        return default
    v = f.contents()
    return v


class _HeaderCut(Exception):
    """A GGUF header that runs past the end of its file."""


_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
                 11: "q", 12: "d"}  # GGUF value type -> struct format
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_expected_size(buf: Any, size: int) -> int:
    """The bytes a GGUF file must have, from its header alone: where its last tensor's data ends.

    Raises _HeaderCut where the header itself runs past `size`, ValueError where it is not a
    GGUF header or makes no sense (an unknown type, more items than the file has bytes).
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    pos = 0

    def take(fmt: str) -> Any:
        nonlocal pos
        n = struct.calcsize(fmt)
        if pos + n > size:
            raise _HeaderCut
        v = struct.unpack_from(fmt, buf, pos)
        pos += n
        return v[0] if len(v) == 1 else v

    def skip(n: int) -> None:
        nonlocal pos
        if pos + n > size:
            raise _HeaderCut
        pos += n

    def count() -> int:
        n = take("<Q")
        if n > size:
            raise ValueError(f"a length of {n:,} in a file of {size:,} bytes")
        return n

    def value(vtype: int) -> Any:
        if vtype == _GGUF_STRING:
            n = count()
            skip(n)
            return bytes(buf[pos - n:pos])
        if vtype == _GGUF_ARRAY:
            itype, n = take("<I"), count()
            if itype in _GGUF_SCALARS:
                skip(n * struct.calcsize(_GGUF_SCALARS[itype]))
            else:
                for _ in range(n):
                    value(itype)
            return None
        if vtype not in _GGUF_SCALARS:
            raise ValueError(f"unknown value type {vtype} in the header")
        return take("<" + _GGUF_SCALARS[vtype])

    if take("<4s") != b"GGUF":
        raise ValueError("it does not start with 'GGUF'")
    version = take("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (ktlong reads 2 and 3)")
    n_tensors, n_kv = count(), count()
    alignment = 32
    for _ in range(n_kv):
        k, v = value(_GGUF_STRING), value(take("<I"))
        if k == b"general.alignment" and isinstance(v, int) and v > 0:
            alignment = v
    tensors = []
    for _ in range(n_tensors):
        value(_GGUF_STRING)
        n_dims = take("<I")
        if n_dims > 8:
            raise ValueError(f"a tensor of {n_dims} dimensions")
        dims = [take("<Q") for _ in range(n_dims)]
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(take("<I"))]
        except (ValueError, KeyError):
            raise ValueError("a tensor of unknown type") from None
        n = 1
        for d in dims:
            n *= d
        tensors.append(take("<Q") + n // block * type_size)
    if not tensors:
        return pos
    return -(-pos // alignment) * alignment + max(tensors)


def open_gguf(path: str | os.PathLike[str]) -> Any:
    """A `GGUFFile` (ktlong.gguffile) over the file, or one clear line on what is wrong with it:
    truncated (its size against the size its header gives), not a GGUF file, or otherwise
    damaged. A good file's header is parsed once, by the reader; `gguf_expected_size` only
    explains a failure."""
    from ktlong.gguffile import GGUFFile

    p = Path(path)
    size = p.stat().st_size
    if size == 0:
        raise KtlongError(f"{p} is empty (0 bytes), not a GGUF model", hint=_REFETCH)
    try:
        reader = GGUFFile(p)
    except Exception as e:  # the reader raises assorted errors on damaged files
        raise _gguf_damage(p, size, e) from None
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if size < end:
        raise KtlongError(f"{p} is truncated: {size:,} bytes, but its header says {end:,}",
                          hint=_REFETCH)
    return reader


_REFETCH = "download or copy the file again"


def _gguf_damage(p: Path, size: int, err: Exception) -> KtlongError:
    """The line for a GGUF file the reader failed on, from ktlong's own parse of its header."""
    import mmap

    try:
        with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            expected = gguf_expected_size(m, size)
    except _HeaderCut:
        return KtlongError(f"{p} is truncated or damaged: its GGUF header runs past the end of "
                           f"the file ({size:,} bytes)", hint=_REFETCH)
    except ValueError as e:
        return KtlongError(f"{p} is not a valid GGUF file: {e}",
                           hint=f"it is damaged or not a GGUF model; {_REFETCH}")
    if size < expected:
        return KtlongError(f"{p} is truncated: {size:,} bytes, but its header says "
                           f"{expected:,}", hint=_REFETCH)
    first = (str(err).splitlines() or [""])[0]
    return KtlongError(f"{p} is damaged: the GGUF reader failed ({type(err).__name__}: {first})",
                       hint=_REFETCH)


def _read_gguf_spec(path: Path) -> ModelSpec:
    reader = open_gguf(path)
    arch = _gguf_value(reader, "general.architecture", "")
    _check_arch(arch, path)

    def key(k: str, default: Any = None) -> Any:
        return _gguf_value(reader, f"{arch}.{k}", default)

    def need(k: str) -> int:
        v = key(k)
        if v is None:
            raise KtlongError(f"{path} has no {arch}.{k} in its metadata",
                              hint="the file is damaged or from a converter ktlong does not "
                                   "know; convert the model again")
        return int(v)

    n_heads = need("attention.head_count")
    hidden = need("embedding_length")
    head_dim = int(key("attention.key_length", hidden // n_heads))
    tokens = reader.get_field("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens is not None else 0
    types: dict[str, int] = {}
    n_bytes = n_params = 0
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        # what the loader holds: the file's bytes (memory-mapped), or BF16 for a type the
        # kernels do not read (widened on load)
        kept = t.tensor_type.name in quant.TYPES
        n_bytes += int(t.n_bytes) if kept else 2 * int(t.n_elements)
        n_params += int(t.n_elements)
    n_layers = need("block_count")
    window = int(key("attention.sliding_window", 0) or 0) if arch == "gemma3" else 0
    sliding = _swa_pattern(n_layers, GEMMA3_SWA_PATTERN) if window > 0 else ()
    rope_scaling = None
    if key("rope.scaling.type") not in (None, "none"):
        rope_scaling = {"type": key("rope.scaling.type"), "factor": key("rope.scaling.factor")}
        original = key("rope.scaling.original_context_length")
        if original:
            rope_scaling["original_context_length"] = int(original)

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
            th.update(k.encode() + f.raw())
    return ModelSpec(
        path=str(path),
        format="gguf",
        arch=arch,
        n_layers=n_layers,
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
        sliding_window=window,
        sliding_layers=sliding,
        rope_local_theta=10000.0 if sliding else 0.0,  # llama.cpp's fixed local base (Gemma 3)
    )
