"""Typed settings: every key with its description, checks, profiles and the user's config.yaml.

Precedence, highest first: flag (overrides) > `KTLONG_<KEY>` env > `--profile NAME|PATH` >
`$KTLONG_HOME/config.yaml` (default home `~/.ktlong`) > defaults. `Resolved.sources[key]` says
which layer gave each value: `default`, `config:<path>`, `profile:<name|path>`, `env:KTLONG_X`
or `flag`.
"""
from __future__ import annotations

import difflib
import json
import math
import os
import re
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from ktlong import configfile
from ktlong.errors import KtlongError


@dataclass(frozen=True)
class FieldSpec:
    """What the CLI knows about a key: kind is int|float|bool|str|enum."""

    kind: str
    default: Any
    description: str
    group: str
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] = ()

    def allowed(self) -> str:
        if self.kind == "enum":
            return "|".join(self.choices)
        if self.kind == "bool":
            return "true|false"
        if self.min is not None and self.max is not None:
            return f"{self.kind} {self.min}..{self.max}"
        if self.min is not None:
            return f"{self.kind} >= {self.min}"
        return self.kind


def _f(kind: str, default: Any, group: str, description: str, lo: float | None = None,
       hi: float | None = None, choices: tuple[str, ...] = ()) -> Any:
    spec = FieldSpec(kind, default, description, group, lo, hi, choices)
    return field(default=default, metadata={"spec": spec})


_KV_TYPES = ("BF16", "FP16", "FP32", "Q8_0", "Q4_0")
MAX_SEQ_LEN = 1 << 24  # 16M tokens: beyond any model's context (a larger number is a typo)
FULL_CONTEXT = 1 << 20  # the longest context ktlong aims for (memcheck, max_seq_len 0)
CHUNK_AUTO = {False: 1024, True: 4096}  # chunk_size 0: tokens per prefill chunk (CPU, CUDA)
_ANCHORS = ("DYNAMIC", "MAX", "MEAN", "QUEST", "FIX")


@dataclass(frozen=True)
class Settings:
    """Every long-context and generation setting. Built from strings too: values are coerced and
    checked on construction (enums accepted in any case), so an invalid Settings cannot exist."""

    # memory
    max_seq_len: int = _f("int", 0, "memory", "Most tokens the KV cache holds (document + "
                          "chat); 0 = what fits in free RAM for the model loaded, up to "
                          f"{FULL_CONTEXT >> 20}M (attention DENSE: up to its max positions)", 0,
                          MAX_SEQ_LEN)
    kv_type: str = _f("enum", "BF16", "memory", "Format of the stored K and V: 16 or 32-bit "
                      "floats, or llama.cpp-style blocks of 32 values with one scale (Q8_0: 8.5 "
                      "bits a value, Q4_0: 4.5)", choices=_KV_TYPES)
    kv_tier: str = _f("enum", "AUTO", "memory", "Where the KV cache lives: RAM, or DISK (a file "
                      "under cache_dir, memory-mapped: the blocks decode reads stay in the page "
                      "cache); AUTO = RAM when max_seq_len's KV fits in free memory, else DISK",
                      choices=("AUTO", "RAM", "DISK"))
    chunk_size: int = _f("int", 0, "memory", "Prefill chunk in tokens; bigger needs more memory "
                         f"for activations; 0 = {CHUNK_AUTO[True]} on CUDA, {CHUNK_AUTO[False]} "
                         "on the CPU, less after a prefill window when the two would read past "
                         "the model's trained context", 0)
    overflow: str = _f("enum", "SHIFT", "memory", "When a chat's (or a served "
                       "request's) next turn would pass max_seq_len: SHIFT drops the oldest "
                       "turns (never the document, system messages or the question) and moves "
                       "the later ones' keys to their new positions (llama.cpp's context "
                       "shift); STOP ends with 'context full' (serve: a 400)",
                       choices=("SHIFT", "STOP"))
    # runtime
    device: str = _f("enum", "AUTO", "runtime", "Where the model runs; AUTO uses CUDA if present",
                     choices=("AUTO", "CPU", "CUDA"))
    weight_type: str = _f("enum", "AUTO", "runtime", "Linear weights on the CPU (activations "
                          "stay FP32); AUTO keeps the checkpoint's own types: a GGUF file's "
                          "quantised tensors are read in place, a 16-bit checkpoint stays 16-bit",
                          choices=("AUTO", "BF16", "FP16", "FP32"))
    prefill_matmul: str = _f("enum", "AUTO", "runtime", "Precision of the prefill matmuls on "
                             "the CPU: INT8 multiplies a GGUF file's quantised blocks by "
                             "activations rounded to int8 (AMX, AVX512-VNNI, AVX-VNNI or AVX2, as "
                             "llama.cpp's Q8 activations); BF16 rounds activations and weight "
                             "tiles to bfloat16 (about 2x the FP32 speed where the CPU has "
                             "BF16 dot products, error ~4e-3 of a row's largest output); "
                             "AUTO = INT8 for quantised layers at least 1024 wide on such a "
                             "CPU, else BF16 on a BF16 CPU for layers at least 512 wide, else "
                             "FP32",
                             choices=("AUTO", "INT8", "BF16", "FP32"))
    threads_num: int = _f("int", 0, "runtime", "CPU threads (kernels and torch); 0 = the cores "
                          "idle when a prefill or an answer starts and every 16 tokens of an "
                          "answer, at least the physical cores less one", 0)
    # sparse attention
    attention: str = _f("enum", "SPARSE", "sparse attention", "SPARSE picks KV blocks per step; "
                        "DENSE reads every token (exact); LOCRET keeps locret_budget tokens of "
                        "the document per layer and KV head (Locret: scored while it is read) "
                        "and reads them all", choices=("SPARSE", "DENSE", "LOCRET"))
    block_size: int = _f("int", 128, "sparse attention", "Tokens per KV block, the unit of "
                         "selection", 1)
    init_len: int = _f("int", 128, "sparse attention", "First tokens always attended (sinks); "
                       "a multiple of block_size", 0)
    local_windows_len: int = _f("int", 4096, "sparse attention", "Last tokens always attended; "
                                "a multiple of block_size", 0)
    second_select_num: int = _f("int", 96, "sparse attention", "Blocks selected per step besides "
                                "init and local; 0 = none", 0)
    anchor_type: str = _f("enum", "MAX", "sparse attention", "How a block is summarised for "
                          "scoring", choices=_ANCHORS)
    anchor_num: int = _f("int", 1, "sparse attention", "Representative keys per block (QUEST: 2)",
                         1)
    head_select_mode: str = _f("enum", "SHARED", "sparse attention", "KV heads pick blocks "
                               "together or each its own", choices=("SHARED", "SEPARATE"))
    dense_layer_num: int = _f("int", 0, "sparse attention", "First layers that read every "
                              "token", 0)
    question_blocks: int = _f("int", 8, "sparse attention", "Blocks the question's last queries "
                              "attend to most, read by every layer at every step of the answer; "
                              "taken from second_select_num (at most all of it); the question "
                              "is read again with them", 0)
    question_window: int = _f("int", 16, "sparse attention", "question_blocks: last prompt "
                              "queries that vote", 1)
    question_layers: int = _f("int", 0, "sparse attention", "question_blocks: layers that vote, "
                              "evenly spaced; 0 = every layer while the votes read at most 4M "
                              "keys in all (to 128K tokens at 32 layers), past that as many as "
                              "they allow (at least 4)", 0)
    question_first_block: bool = _f("bool", True, "sparse attention", "question_blocks: the "
                                    "first block (read first at every step) is voted on too, "
                                    "less the chat template's tokens; when it comes first, its "
                                    "document tokens are read once more just before the local "
                                    "window")
    question_positions: str = _f("enum", "NEAR", "sparse attention", "question_blocks: NEAR "
                                 "reads them as if they sat just before the local window (the "
                                 "query turned back by each one's distance); AS_IS at their "
                                 "own positions (with block_positions COMPACT: in document "
                                 "order among the other blocks)", choices=("NEAR", "AS_IS"))
    question_votes: str = _f("enum", "NEAR", "sparse attention", "question_blocks: AS_IS "
                             "votes on each block at its own distance; NEAR as if it sat just "
                             "before the local window (the question's queries turned back by its "
                             "distance), so past the trained length the votes do not all go to "
                             "the document's first blocks", choices=("AS_IS", "NEAR"))
    block_positions: str = _f("enum", "COMPACT", "sparse attention", "COMPACT reads the blocks "
                              "before the local window (init, selected, the question's) as one "
                              "run of text ending where the window starts, so no key is read "
                              "from further than the step's budget (the query turned back per "
                              "block), and a WINDOW prefill reads the first init_len tokens as "
                              "the ones just before its window; AS_IS at their own positions",
                              choices=("COMPACT", "AS_IS"))
    score_positions: str = _f("enum", "NEAR", "sparse attention", "NEAR scores every block "
                              "as if it sat just before the local window (anchors of keys turned "
                              "back to position 0, the query turned to the window's length), so "
                              "a far block is not outscored by near ones for its distance alone; "
                              "AS_IS at its own distance", choices=("NEAR", "AS_IS"))
    select_neighbours: bool = _f("bool", False, "sparse attention", "Each selected block brings "
                                 "the block after it, within the same budget")
    spread_blocks: int = _f("int", 0, "sparse attention", "Of the selected blocks, this many "
                            "are spread over the document: the candidates cut into that many "
                            "equal runs, each run's best-scoring block taken; the rest by "
                            "score. 0 = none; not with select_neighbours", 0)
    token_step: int = _f("int", 1, "sparse attention", "Reselect blocks every N new tokens", 1)
    layer_step: int = _f("int", 1, "sparse attention", "Reselect blocks every N layers", 1)
    layer_budget: str = _f("enum", "UNIFORM", "sparse attention", "How the selected blocks are "
                           "shared among the sparse layers: UNIFORM, second_select_num each; "
                           "SQUEEZE (SqueezeAttention): the prefill measures how little each "
                           "layer changes its input (cosine of its input and output hidden "
                           "states), 1-D k-means puts the layers in 3 groups, the least changing "
                           "group keeps squeeze_ratio of its blocks and the most changing group "
                           "gets the rest; the total stays", choices=("UNIFORM", "SQUEEZE"))
    squeeze_ratio: float = _f("float", 0.5, "sparse attention", "SQUEEZE: share of "
                              "second_select_num kept by the least important layers", 0.0, 1.0)
    gpu_local_window: bool = _f("bool", True, "sparse attention", "Attend to the local window on "
                                "the GPU when there is one")
    # prefill (how a document's tokens attend while it is read)
    prefill: str = _f("enum", "AUTO", "prefill", "DENSE: every earlier token (exact); WINDOW: "
                      "init_len + prefill_window tokens; MINFERENCE: per-head sparse patterns "
                      "(MInference); AUTO: MINFERENCE inside the model's trained context (and "
                      "a sixteenth), WINDOW past it",
                      choices=("DENSE", "WINDOW", "MINFERENCE", "AUTO"))
    prefill_window: int = _f("int", 16384, "prefill", "WINDOW, AUTO: past tokens each prompt token "
                             "attends while a document is read, besides init_len; 0 = all "
                             "(exact)", 0)
    prefill_vertical: int = _f("int", 1024, "prefill", "MINFERENCE: key columns per head "
                               "without a tuned pattern (Vertical-Slash)", 0)
    prefill_slash: int = _f("int", 2048, "prefill", "MINFERENCE: diagonals per head without a "
                            "tuned pattern (Vertical-Slash)", 1)
    prefill_patterns: str = _f("str", "", "prefill", "MINFERENCE: pattern file of `ktlong tune "
                               "prefill`; empty = the model's tuned file if any, else every head "
                               "Vertical-Slash")
    # Locret (attention LOCRET: a fixed KV budget for the document)
    locret_budget: int = _f("int", 4096, "locret", "Tokens of the document kept per layer and KV "
                            "head; the KV held stays this plus one prefill chunk, however long "
                            "the document", 1)
    locret_stabilisers: int = _f("int", 512, "locret", "Last tokens kept whatever their score "
                                 "(part of locret_budget)", 0)
    locret_scores: str = _f("enum", "HEADS", "locret", "What ranks the tokens: HEADS, the "
                            "model's retaining heads (ktlong train-heads); ATTENTION, the largest "
                            "attention the chunk's last queries give each token (H2O/SnapKV-"
                            "style); RECENT, the first init_len and the newest (StreamingLLM); "
                            "SURPRISE, the model's own surprise at each line of the document (no "
                            "training)",
                            choices=("HEADS", "ATTENTION", "RECENT", "SURPRISE"))
    locret_heads: str = _f("str", "", "locret", "Retaining-heads file; empty = the model's, "
                           "trained by `ktlong train-heads` or shipped")
    locret_recall: int = _f("int", 512, "locret", "Tokens of the document re-read before each "
                            "question: the passages holding the question's rarest words, with "
                            "64 tokens either side (ktlong/recall.py); 0 = only what was kept",
                            0)
    # preselection (SnapKV-style, once per question)
    preselect_block: bool = _f("bool", False, "preselection", "Preselect blocks once per "
                               "question; decode picks only among them")
    preselect_block_count: int = _f("int", 96, "preselection", "Blocks kept by preselection", 0)
    preselect_window: int = _f("int", 64, "preselection", "Last prompt queries that vote "
                               "(preselection, DYNAMIC anchors)", 1)
    preselect_pool: int = _f("int", 7, "preselection", "Pooling width over the votes; odd, "
                             "1 = none", 1)
    # generation
    max_new_tokens: int = _f("int", 512, "generation", "Most tokens generated per answer", 1)
    temperature: float = _f("float", 0.0, "generation", "Sampling temperature; 0 = greedy", 0.0)
    top_p: float = _f("float", 1.0, "generation", "Nucleus sampling mass in (0, 1]", 0.0, 1.0)
    top_k: int = _f("int", 0, "generation", "Sample among the k likeliest tokens; 0 = all", 0)
    seed: int = _f("int", -1, "generation", "Random seed; -1 = random", -1)
    # prompt cache
    cache_dir: str = _f("str", "", "prompt cache", "Folder of prompt caches; empty = "
                        "$KTLONG_HOME/cache")
    cache_max_gb: float = _f("float", 64.0, "prompt cache", "Evict old prompt caches beyond this "
                             "many GB", 0.0)

    def __post_init__(self) -> None:
        values = {}
        for name in FIELDS:
            values[name] = coerce(name, getattr(self, name), "Settings")
            object.__setattr__(self, name, values[name])
        # the question's blocks are taken from the budget: a smaller budget is theirs whole
        values["question_blocks"] = min(values["question_blocks"], values["second_select_num"])
        object.__setattr__(self, "question_blocks", values["question_blocks"])
        check(values)

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in FIELDS}


FIELDS: dict[str, FieldSpec] = {f.name: f.metadata["spec"] for f in fields(Settings)}


def window_reads(s: Any) -> int:
    """Tokens a WINDOW or AUTO prefill reads before a chunk, init_len + prefill_window, once the
    context is longer (0: no window, every earlier token; AUTO reads a context within the model's
    trained length through its patterns instead: `minference.auto_reach`)."""
    return s.init_len + s.prefill_window if s.prefill in ("WINDOW", "AUTO") \
        and s.prefill_window else 0


def reads_patterns(s: Any) -> bool:
    """A MINFERENCE prefill, or an AUTO one (inside the model's trained length)."""
    return s.prefill in ("MINFERENCE", "AUTO")


_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def parse_int(text: str) -> int:
    """'4096', '4_096', '128K' (x1024) or '1M' (x1048576) -> int; ValueError otherwise."""
    t = text.strip().replace("_", "")
    mult = {"k": 1024, "m": 1024 * 1024}.get(t[-1:].lower(), 1)
    return int(t[:-1] if mult > 1 else t) * mult


def coerce(key: str, value: Any, origin: str) -> Any:
    """Turn a YAML/env/flag value into the key's type, range-checked; KtlongError names `origin`."""
    spec = FIELDS[key]
    bad = KtlongError(f"{origin}: {key} must be {spec.allowed()}, got {value!r}",
                      hint=f"{key}: {spec.description}")
    if spec.kind == "str":
        return "" if value is None else str(value)
    if isinstance(value, (list, dict)) or value is None:
        raise bad
    if spec.kind == "enum":
        v = str(value).strip().upper()
        if v not in spec.choices:
            raise bad
        return v
    if spec.kind == "bool":
        if isinstance(value, bool):
            return value
        t = str(value).strip().lower()
        if t in _TRUE or t in _FALSE:
            return t in _TRUE
        raise bad
    if isinstance(value, bool):
        raise bad
    try:
        if spec.kind == "int":
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            v = parse_int(value) if isinstance(value, str) else int(value)
        else:
            v = float(value)
            if not math.isfinite(v):
                raise ValueError
    except (ValueError, TypeError, OverflowError):
        raise bad from None
    if (spec.min is not None and v < spec.min) or (spec.max is not None and v > spec.max):
        raise KtlongError(f"{origin}: {key} = {value} is out of range, must be {spec.allowed()}",
                          hint=f"{key}: {spec.description}")
    return v


def check(v: dict[str, Any], sources: dict[str, str] | None = None) -> None:
    """Cross-field rules. Messages say where each value came from when `sources` is given."""

    def at(*keys: str) -> str:
        if not sources:
            return ""
        return " (" + ", ".join(f"{k} from {sources[k]}" for k in keys) + ")"

    bs = v["block_size"]
    if v["anchor_type"] == "QUEST" and v["anchor_num"] != 2:
        raise KtlongError(f"anchor_type QUEST needs anchor_num 2, got {v['anchor_num']}"
                          + at("anchor_type", "anchor_num"),
                          hint="set anchor_num: 2 (QUEST keeps each block's channel min and max)")
    if v["anchor_num"] > bs:
        raise KtlongError(f"anchor_num {v['anchor_num']} is more than block_size {bs}"
                          + at("anchor_num", "block_size"),
                          hint=f"set anchor_num to at most {bs}")
    for key in ("init_len", "local_windows_len"):
        if v[key] % bs:
            lo, hi = v[key] // bs * bs, (v[key] // bs + 1) * bs
            raise KtlongError(f"{key} {v[key]} is not a multiple of block_size {bs}"
                              + at(key, "block_size"), hint=f"set {key} to {lo} or {hi}")
    if v["preselect_block"] and v["second_select_num"] == 0:
        raise KtlongError("preselect_block is on but second_select_num is 0"
                          + at("preselect_block", "second_select_num"),
                          hint="set second_select_num above 0, or preselect_block: false")
    if v["preselect_block"] and v["preselect_block_count"] == 0:
        raise KtlongError("preselect_block is on but preselect_block_count is 0"
                          + at("preselect_block", "preselect_block_count"),
                          hint="set preselect_block_count above 0 (e.g. 96)")
    if v["spread_blocks"] and v["select_neighbours"]:
        raise KtlongError("spread_blocks and select_neighbours are both on"
                          + at("spread_blocks", "select_neighbours"),
                          hint="use one: spread_blocks: 0, or select_neighbours: false")
    if v["preselect_pool"] % 2 == 0:
        raise KtlongError(f"preselect_pool must be odd, got {v['preselect_pool']}"
                          + at("preselect_pool"), hint="use 1 (no pooling), 3, 5, 7, ...")
    if v["top_p"] <= 0.0:
        raise KtlongError(f"top_p must be in (0, 1], got {v['top_p']}" + at("top_p"),
                          hint="use 1.0 to turn nucleus sampling off")


# --- homes, profiles, layers -------------------------------------------------------------------

def ktlong_home() -> Path:
    """`$KTLONG_HOME`, else `~/.ktlong`."""
    env = os.environ.get("KTLONG_HOME")
    return Path(env).expanduser() if env else Path.home() / ".ktlong"


def _builtin_profiles() -> dict[str, Any]:
    root = resources.files("ktlong.profiles")
    return {p.name[:-5]: p for p in root.iterdir() if p.name.endswith(".yaml")}


def _user_profiles() -> dict[str, Path]:
    folder = ktlong_home() / "profiles"
    return {p.stem: p for p in folder.glob("*.yaml")} if folder.is_dir() else {}


def available_profiles() -> list[str]:
    """Profile names: built-in ones and `$KTLONG_HOME/profiles/*.yaml` (which win on a clash)."""
    return sorted(set(_builtin_profiles()) | set(_user_profiles()))


def profile_text(profile: str) -> tuple[str, str, str]:
    """(label for sources, origin for messages, YAML text) of a profile name or path."""
    looks_like_path = os.sep in profile or "/" in profile or profile.endswith((".yaml", ".yml"))
    if looks_like_path:
        p = Path(profile).expanduser()
        if not p.is_file():
            raise KtlongError(f"profile file {p} does not exist",
                              hint=f"built-in profiles: {', '.join(available_profiles())}")
        return str(p), str(p), configfile.read_text(p)
    user = _user_profiles()
    if profile in user:
        return profile, str(user[profile]), configfile.read_text(user[profile])
    builtin = _builtin_profiles()
    if profile in builtin:
        return profile, str(builtin[profile]), builtin[profile].read_text(encoding="utf-8")
    close = difflib.get_close_matches(profile, available_profiles(), n=1)
    raise KtlongError(f"no profile named '{profile}'" + (f" (did you mean '{close[0]}'?)" if close
                                                           else ""),
                      hint=f"available: {', '.join(available_profiles())}; or pass a .yaml path")


def unknown_key(key: str, where: str) -> KtlongError:
    close = difflib.get_close_matches(key, list(FIELDS), n=1, cutoff=0.5)
    return KtlongError(f"{where}: unknown setting '{key}'"
                       + (f"; did you mean '{close[0]}'?" if close else ""),
                       hint="`ktlong inspect config --explain` lists every setting")


def load_layer(text: str, origin: str) -> dict[str, Any]:
    """Parse and type-check one YAML layer (config file or profile)."""
    out = {}
    for key, entry in configfile.parse_mapping(text, origin).items():
        where = f"{origin}:{entry.line}"
        if key not in FIELDS:
            raise unknown_key(key, where)
        out[key] = coerce(key, entry.value, where)
    return out


@dataclass(frozen=True)
class Resolved:
    settings: Settings
    sources: dict[str, str]
    config_file: Path
    notes: tuple[str, ...] = ()  # lines for the user (`ktlong.fit`: what was fitted, warnings)
    home_error: str = ""  # why KTLONG_HOME cannot be written (then: defaults, no prompt cache)


# Defaults that changed since a first run copied them into config.yaml: such a value there reads as
# today's default (a user who wants the old value sets it in a profile, or a flag).
FORMER_DEFAULTS: dict[str, tuple[Any, ...]] = {"prefill_window": (12288,), "prefill": ("WINDOW",)}


def resolve_settings(profile: str | None = None,
                     overrides: dict[str, Any] | None = None,
                     config_file: bool = True) -> Resolved:
    """Merge defaults < config.yaml < profile < env < overrides, then check the result.

    Creates (or completes) `config.yaml` on the way. Overrides whose value is None are ignored.
    `config_file=False` (benchmarks) leaves config.yaml out, so figures do not depend on edits.
    """
    path, home_error = ktlong_home() / "config.yaml", ""
    if config_file:
        try:
            path = ensure_config()
        except HomeUnwritable as e:  # a read-only home still chats: defaults, no cache
            home_error, config_file = e.message, False
    values = {k: s.default for k, s in FIELDS.items()}
    sources = dict.fromkeys(FIELDS, "default")

    def apply(layer: dict[str, Any], label: str) -> None:
        values.update(layer)
        sources.update(dict.fromkeys(layer, label))

    if config_file:
        text = configfile.read_text(path)
        layer = load_layer(text, str(path))
        if first_run_note(text, str(path)):
            layer["max_seq_len"] = 0  # the number an older first run chose for an 8B model
        apply(layer, f"config:{path}")
        for key, old in FORMER_DEFAULTS.items():  # a copy of an older default follows the new
            if key in layer and layer[key] in old:
                values[key] = FIELDS[key].default
                sources[key] = f"default (config.yaml's {layer[key]} was an older default)"
    if profile:
        label, origin, text = profile_text(profile)
        apply(load_layer(text, origin), f"profile:{label}")
    for key in FIELDS:
        var = f"KTLONG_{key.upper()}"
        raw = os.environ.get(var, "")
        if raw != "":
            apply({key: coerce(key, raw, f"environment {var}")}, f"env:{var}")
    for key, raw in (overrides or {}).items():
        key = key.replace("-", "_")
        if key not in FIELDS:
            raise unknown_key(key, "flag")
        if raw is not None:
            apply({key: coerce(key, raw, "flag")}, "flag")
    check(values, sources)
    notes = (f"warning: {home_error}: default settings, no prompt cache (set KTLONG_HOME to a "
             "folder you can write to)",) if home_error else ()
    return Resolved(Settings(**values), sources, path, notes, home_error)


# --- the user's config.yaml: written once, then only appended to -------------------------------

_HEADER = """\
# ktlong settings, written by ktlong {version} on first run. Edit freely: ktlong never rewrites
# this file; a newer ktlong only appends the keys it adds. Precedence, highest first: flags,
# KTLONG_<KEY> environment variables, --profile, this file, built-in defaults.
# `ktlong inspect config --explain` describes every key and shows where each value comes from.
"""


def yaml_value(value: Any) -> str:
    """A value as YAML text that reads back as the same value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value.isidentifier() and value.lower() not in _TRUE + _FALSE + ("null",) \
            else json.dumps(value)
    return repr(value)


def _entry(key: str, value: Any) -> str:
    spec = FIELDS[key]
    return f"# {spec.description} ({spec.allowed()})\n{key}: {yaml_value(value)}\n"


_FIRST_RUN_NOTE = re.compile(r"# chosen from .* free DRAM for an 8B model")


def first_run_note(text: str, origin: str) -> int | None:
    """The line (1-based) of the note an older first run wrote above the max_seq_len it chose
    for an 8B model, when the file still has it: that number means 0 (what fits the model)."""
    entry = configfile.parse_mapping(text, origin).get("max_seq_len")
    lines = text.splitlines()
    if entry is None or entry.line < 2 or not _FIRST_RUN_NOTE.match(lines[entry.line - 2]):
        return None
    return entry.line - 1


def write_values(path: Path, values: dict[str, str]) -> None:
    """Set keys of config.yaml in one edit (`memcheck --write`). An older first run's note above
    max_seq_len goes with it: the number written is the user's own."""
    if not path.exists():
        path = ensure_config()  # a home that cannot be written says so in one line
    note = first_run_note(configfile.read_text(path), str(path))
    configfile.set_values(path, values, drop_comments=(note,) if note else ())


def render_config(values: dict[str, Any]) -> str:
    """The whole first-run file: a header, then each group's keys with a comment each."""
    from ktlong import __version__

    out = [_HEADER.format(version=__version__)]
    group = None
    for key, spec in FIELDS.items():
        if spec.group != group:
            group = spec.group
            out.append(f"\n# -- {group} --\n")
        out.append(_entry(key, values[key]))
    return "".join(out)


class HomeUnwritable(KtlongError):
    """KTLONG_HOME or its config.yaml cannot be made (read-only, full, under a file)."""


def ensure_config() -> Path:
    """Make sure `$KTLONG_HOME/config.yaml` exists and holds every key; return its path.

    First run writes it whole. Later, keys it lacks are appended with their defaults (the user's
    text stays byte for byte). A file that does not parse is left untouched and reported.
    """
    home = ktlong_home()
    path = home / "config.yaml"
    fix = "set KTLONG_HOME to a folder you can write to"
    try:
        home.mkdir(parents=True, exist_ok=True)
        exists = path.exists()
    except OSError as e:
        raise HomeUnwritable(f"cannot use {home} as the ktlong home: {e.strerror or e}",
                             hint=fix) from None
    if not exists:
        try:
            configfile.atomic_write(path, render_config({k: s.default for k, s in FIELDS.items()}))
        except OSError as e:
            raise HomeUnwritable(f"cannot write {path}: {e.strerror or e}", hint=fix) from None
        return path
    present = configfile.parse_mapping(configfile.read_text(path), str(path))
    missing = [k for k in FIELDS if k not in present]
    if missing and set(present) <= set(FIELDS):  # an unknown key may be a typo of a missing one
        from ktlong import __version__

        block = f"\n# -- added by ktlong {__version__} --\n"
        for key in missing:
            block += _entry(key, FIELDS[key].default)
        try:
            configfile.append_block(path, block)
        except OSError:
            pass  # a read-only home still works: missing keys take their defaults
    return path
