"""Models where users already keep them, found by name, offline: `-m NAME` in every command.

- ollama (`$OLLAMA_MODELS`, else `~/.ollama/models`): `-m NAME[:TAG]` (TAG latest by default;
  `USER/NAME:TAG`, `HOST/USER/NAME:TAG` for other namespaces) reads
  `manifests/HOST/NAMESPACE/NAME/TAG`, a JSON manifest whose layer of media type
  `application/vnd.ollama.image.model` names the GGUF blob (`blobs/sha256-HEX`). The blob has no
  `.gguf` name, so ktlong opens it through a link `$KTLONG_HOME/models/ollama/NAME-TAG.gguf`.
- The Hugging Face hub cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
  `~/.cache/huggingface/hub`): `-m ORG/REPO` reads `models--ORG--REPO/refs/main` for the snapshot
  (`snapshots/REV/`, files linked to `blobs/`): its one GGUF file, or its safetensors folder
  (config.json). A repo with several GGUF files takes the quant by name: `-m ORG/REPO:Q4_K_M`.
- LM Studio (`~/.lmstudio/models`, and the older `~/.cache/lm-studio/models`):
  `-m PUBLISHER/REPO[:QUANT]`, the GGUF files in `PUBLISHER/REPO/`.
- ktlong's own names (`ktlong.registry`: smollm2, gemma3-270m), looked at first.

A name found in more than one place takes the first in that order (ktlong, ollama, hub, LM Studio)
and says so in one line on stderr. `ktlong models` lists what all of them hold. Stdlib only at
import (`--help` stays fast); the GGUF metadata for the listing is read on demand.
"""
from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ktlong.errors import KtlongError

GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"  # as ktlong.registry assembles it
OLLAMA_HOST = "registry.ollama.ai"
OLLAMA_MODEL = "application/vnd.ollama.image.model"
STORES = ("ktlong", "ollama", "huggingface", "lmstudio")
LABELS = {"ktlong": "ktlong's names", "ollama": "ollama", "huggingface": "the Hugging Face hub "
          "cache", "lmstudio": "LM Studio"}
_QUANT = re.compile(r"(?<![A-Za-z0-9])(I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32)(?![A-Za-z0-9])", re.I)
# GGUF general.file_type (llama.cpp's LLAMA_FTYPE) -> its name
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
              10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M",
              16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 32: "BF16"}


@dataclass(frozen=True)
class Found:
    name: str  # what -m takes
    store: str  # one of STORES
    path: Path  # what the loader opens: a .gguf file or a Hugging Face folder
    source: Path  # where it lies in its store (the blob, snapshot file or folder)
    size: int  # bytes on disk


# --- where each store lives ---------------------------------------------------------------------
def _home() -> Path:
    return Path(os.path.expanduser("~"))


def ollama_root() -> Path:
    env = os.environ.get("OLLAMA_MODELS")
    return Path(env).expanduser() if env else _home() / ".ollama" / "models"


def hub_root() -> Path:
    """As huggingface_hub picks it: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub
    (XDG_CACHE_HOME moves ~/.cache)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache = os.environ.get("XDG_CACHE_HOME")
    return (Path(cache).expanduser() if cache else _home() / ".cache") / "huggingface" / "hub"


def lmstudio_roots() -> list[Path]:
    return [_home() / ".lmstudio" / "models", _home() / ".cache" / "lm-studio" / "models"]


def places() -> list[str]:
    """Where a name is looked for, in words (the not-found message)."""
    from ktlong.registry import known

    return [f"ktlong's names ({', '.join(known())})", f"ollama ({ollama_root()})",
            f"the Hugging Face hub cache ({hub_root()})",
            "LM Studio (" + ", ".join(str(p) for p in lmstudio_roots()) + ")"]


# --- names --------------------------------------------------------------------------------------
def looks_like_name(text: str) -> bool:
    """`NAME[:TAG]`, `ORG/REPO[:QUANT]` or `HOST/NS/NAME:TAG`: no leading `/ . ~`, no backslash,
    at most two slashes, not a model file's name."""
    if not text or text[0] in "/.~" or "\\" in text or text.count("/") > 2:
        return False
    return not text.lower().endswith((".gguf", ".safetensors", ".json"))


def _split_tag(text: str) -> tuple[str, str]:
    name, _, tag = text.partition(":")
    return name, tag


def _ggufs(folder: Path) -> list[Path]:
    """The model GGUF files in a folder (its subfolders too), projector files left out."""
    out = [p for p in folder.rglob("*.gguf") if not p.name.lower().startswith("mmproj")]
    return sorted(out, key=lambda p: str(p).lower())


def quant_of(name: str) -> str:
    m = _QUANT.search(Path(name).stem)
    return m.group(1).upper() if m else ""


def _pick(files: list[Path], quant: str, what: str, name: str) -> Path:
    """The GGUF file among `files` whose name carries `quant` (any when only one)."""
    if quant:
        hits = [p for p in files if quant_of(p.name) == quant.upper()]
        if not hits:
            hits = [p for p in files if quant.lower() in p.name.lower()]
        if len(hits) == 1:
            return hits[0]
        have = ", ".join(quant_of(p.name) or p.name for p in files)
        raise KtlongError(f"{what} {name} has {'no' if not hits else 'several'} GGUF files for "
                          f"{quant} (it has {have})",
                          hint=f"name one: -m {name}:{quant_of(files[0].name) or 'QUANT'}")
    if len(files) == 1:
        return files[0]
    have = ", ".join(quant_of(p.name) or p.name for p in files)
    raise KtlongError(f"{what} {name} holds several GGUF files ({have}): say which",
                      hint=f"e.g. -m {name}:{quant_of(files[0].name) or 'QUANT'}")


# --- ollama -------------------------------------------------------------------------------------
def _ollama_manifest(name: str) -> Path:
    base, tag = _split_tag(name)
    parts = base.split("/")
    if len(parts) == 1:
        parts = [OLLAMA_HOST, "library", *parts]
    elif len(parts) == 2:
        parts = [OLLAMA_HOST, *parts]
    return ollama_root().joinpath("manifests", *parts, tag or "latest")


def _ollama_blob(manifest: Path) -> Path | None:
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for layer in data.get("layers", []) if isinstance(data, dict) else []:
        if isinstance(layer, dict) and layer.get("mediaType") == OLLAMA_MODEL:
            digest = str(layer.get("digest", ""))
            blobs = ollama_root() / "blobs"
            for candidate in (blobs / digest.replace(":", "-"), blobs / digest):
                if candidate.is_file():
                    return candidate
    return None


def _ollama_link(name: str, blob: Path) -> Path:
    """A `.gguf` name for the blob in $KTLONG_HOME/models/ollama (made or refreshed atomically)."""
    from ktlong.config import ktlong_home

    base, tag = _split_tag(name)
    folder = ktlong_home() / "models" / "ollama"
    link = folder / (re.sub(r"[^A-Za-z0-9._-]+", "-", base) + f"-{tag or 'latest'}.gguf")
    try:
        if link.resolve() == blob.resolve() and link.is_file():
            return link
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{link.name}.{os.getpid()}.tmp"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(blob)
        os.replace(tmp, link)
    except OSError as e:
        raise KtlongError(f"cannot link ollama's {name} into {folder}: {e.strerror or e}",
                          hint=f"pass the blob itself by path: copy {blob} to a .gguf file") \
            from None
    return link


def find_ollama(name: str) -> Found | None:
    if ":" in name.partition("/")[0] and "/" in name:  # a HOST:PORT/... is not a local name
        return None
    manifest = _ollama_manifest(name)
    if not manifest.is_file():
        return None
    blob = _ollama_blob(manifest)
    if blob is None:
        return None
    return Found(name if ":" in name else f"{name}:latest", "ollama", blob, blob,
                 blob.stat().st_size)


def list_ollama() -> Iterator[Found]:
    root = ollama_root() / "manifests"
    if not root.is_dir():
        return
    for manifest in sorted(root.glob("*/*/*/*")):
        host, ns, model, tag = manifest.relative_to(root).parts
        name = (f"{model}:{tag}" if (host, ns) == (OLLAMA_HOST, "library") else
                f"{ns}/{model}:{tag}" if host == OLLAMA_HOST else f"{host}/{ns}/{model}:{tag}")
        blob = _ollama_blob(manifest) if manifest.is_file() else None
        if blob is not None:
            yield Found(name, "ollama", blob, blob, blob.stat().st_size)


# --- Hugging Face hub cache ---------------------------------------------------------------------
def _snapshot(repo_dir: Path) -> Path | None:
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        snap = repo_dir / "snapshots" / ref.read_text(encoding="utf-8").strip()
        if snap.is_dir():
            return snap
    snaps = [p for p in (repo_dir / "snapshots").glob("*") if p.is_dir()]
    return max(snaps, key=lambda p: p.stat().st_mtime) if snaps else None


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _repo_models(repo: str, folder: Path, store: str, quant: str = "") -> list[Found]:
    """The models in a repo folder (a snapshot, an LM Studio folder): its safetensors folder
    and/or each GGUF file (one Found per file; only the one named by `quant` when given)."""
    out = []
    ggufs = _ggufs(folder)
    if quant:
        p = _pick(ggufs, quant, LABELS[store], repo) if ggufs else None
        return [Found(f"{repo}:{quant_of(p.name) or quant}", store, p, p, p.stat().st_size)] \
            if p else []
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        out.append(Found(repo, store, folder, folder, _size(folder)))
    for p in ggufs:
        tag = quant_of(p.name) or p.stem
        out.append(Found(repo if len(ggufs) == 1 and not out else f"{repo}:{tag}", store, p, p,
                         p.stat().st_size))
    return out


def _resolve_repo(repo: str, quant: str, folder: Path | None, store: str) -> Found | None:
    if folder is None or not folder.is_dir():
        return None
    if quant:
        found = _repo_models(repo, folder, store, quant)
        return found[0] if found else None
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return Found(repo, store, folder, folder, _size(folder))
    ggufs = _ggufs(folder)
    if not ggufs:
        return None
    p = _pick(ggufs, "", LABELS[store], repo)
    return Found(repo, store, p, p, p.stat().st_size)


def find_hub(name: str) -> Found | None:
    repo, quant = _split_tag(name)
    if repo.count("/") != 1:
        return None
    org, model = repo.split("/")
    repo_dir = hub_root() / f"models--{org}--{model}"
    return _resolve_repo(repo, quant, _snapshot(repo_dir) if repo_dir.is_dir() else None,
                         "huggingface")


def list_hub() -> Iterator[Found]:
    root = hub_root()
    if not root.is_dir():
        return
    for repo_dir in sorted(root.glob("models--*--*")):
        _, org, model = repo_dir.name.split("--", 2)
        snap = _snapshot(repo_dir)
        if snap is not None:
            yield from _repo_models(f"{org}/{model}", snap, "huggingface")


# --- LM Studio ----------------------------------------------------------------------------------
def find_lmstudio(name: str) -> Found | None:
    repo, quant = _split_tag(name)
    if repo.count("/") != 1:
        return None
    for root in lmstudio_roots():
        found = _resolve_repo(repo, quant, root / repo, "lmstudio")
        if found is not None:
            return found
    return None


def list_lmstudio() -> Iterator[Found]:
    seen = set()
    for root in lmstudio_roots():
        for folder in sorted(p for p in root.glob("*/*") if p.is_dir()):
            repo = "/".join(folder.relative_to(root).parts)
            if repo not in seen:
                seen.add(repo)
                yield from _repo_models(repo, folder, "lmstudio")


# --- ktlong's own -------------------------------------------------------------------------------
def find_ktlong(name: str) -> Found | None:
    from ktlong.registry import lookup

    model = lookup(name)
    if model is None:
        return None
    path = model.locate(model)
    return Found(model.name, "ktlong", path, path, path.stat().st_size)


def list_ktlong() -> Iterator[Found]:
    """ktlong's names whose file is on disk now (Gemma 3 once assembled): nothing is written."""
    from ktlong.config import ktlong_home
    from ktlong.registry import MODELS

    for model in MODELS:
        if model.name == "gemma3-270m":  # locate() would assemble it: only once it has been
            path: Path | None = ktlong_home() / "models" / GEMMA3_FILE
        else:
            try:
                path = model.locate(model)
            except KtlongError:
                path = None
        if path is not None and path.is_file():
            yield Found(model.name, "ktlong", path, path, path.stat().st_size)


# --- resolving ----------------------------------------------------------------------------------
FINDERS = (("ktlong", find_ktlong), ("ollama", find_ollama), ("huggingface", find_hub),
           ("lmstudio", find_lmstudio))


def find(name: str) -> Found | None:
    """The model `-m name` means: the first store that holds it (a line on stderr when another
    holds it too), None when none does."""
    hits, problems = [], []
    for _, finder in FINDERS:
        try:
            found = finder(name)
        except KtlongError as e:  # e.g. ktlong's name whose package is missing: another
            problems.append(e)  # store may hold the name
            continue
        if found is not None:
            hits.append(found)
    if not hits:
        if problems:
            raise problems[0]
        return None
    first = hits[0]
    if len(hits) > 1:
        others = "; ".join(f"{LABELS[f.store]} ({f.source})" for f in hits[1:])
        print(f"model {name}: using the one in {LABELS[first.store]} ({first.source}); also "
              f"in {others}", file=sys.stderr, flush=True)
    if first.store == "ollama":
        return Found(first.name, first.store, _ollama_link(first.name, first.path),
                     first.source, first.size)
    return first


def not_found(name: str, near: str = "") -> KtlongError:
    """One line: the name is no path, and where it was looked for."""
    return KtlongError(f"model {name}: no such file or folder, and no model of that name in "
                       + "; ".join(places()) + (f" (did you mean {near}?)" if near else ""))


def everything() -> list[Found]:
    return [*list_ktlong(), *list_ollama(), *list_hub(), *list_lmstudio()]


# --- ktlong models ------------------------------------------------------------------------------
def describe(found: Found, settings: Any, free_dram: int) -> dict[str, Any]:
    """One row of `ktlong models`: what the model is (from its metadata) and the context that
    fits in free memory for it (memcheck's figure: `max_seq_len 0`)."""
    from ktlong.fit import auto_max_seq_len
    from ktlong.spec import read_spec, trained_context

    row: dict[str, Any] = {"name": found.name, "store": found.store, "path": str(found.source),
                           "size": found.size, "arch": None, "quant": None,
                           "trained_context": None, "fits": None, "problem": None}
    try:
        path = _ollama_link(found.name, found.path) if found.store == "ollama" else found.path
        spec = read_spec(path, need_weights=False)
    except (KtlongError, OSError, ValueError) as e:
        row["problem"] = str(e).splitlines()[0]
        return row
    row["arch"] = spec.arch
    row["quant"] = _gguf_quant(spec) if spec.format == "gguf" else \
        max(spec.weight_types, key=spec.weight_types.get) if spec.weight_types else None
    row["trained_context"] = trained_context(spec) or None
    row["fits"] = auto_max_seq_len(spec, settings, free_dram)[0]
    return row


def _gguf_quant(spec: Any) -> str | None:
    from ktlong.spec import open_gguf

    field = open_gguf(spec.path).get_field("general.file_type")
    if field is not None:
        value = field.contents()
        if isinstance(value, int) and value in FILE_TYPES:
            return FILE_TYPES[value]
    return quant_of(Path(spec.path).name) or (
        max(spec.weight_types, key=spec.weight_types.get) if spec.weight_types else None)


def list_main(settings: Any, as_json: bool) -> None:
    """`ktlong models`: every model the stores hold, a table or JSON on stdout."""
    from ktlong import memory, render

    free = memory.free_dram_bytes()
    rows = [describe(f, settings, free) for f in everything()]
    if as_json:
        render.print_json({"models": [*rows], "looked_in": places(),
                           "kv_type": settings.kv_type, "free_dram": free})
        return
    from rich.table import Table

    table = Table(title=f"models ktlong finds (context that fits: {settings.kv_type} KV in "
                        f"{memory.gb(free)} of free RAM)")
    for col in ("name", "store", "size", "arch", "quant", "trained", "fits", "path"):
        table.add_column(col, justify="right" if col in ("size", "trained", "fits") else "left",
                         overflow="fold")
    home = str(_home())
    for r in rows:
        path = "~" + r["path"][len(home):] if r["path"].startswith(home + os.sep) else r["path"]
        table.add_row(r["name"], r["store"], memory.size(r["size"]),
                      r["arch"] or (r["problem"] or "?"), r["quant"] or "",
                      memory.tokens_label(r["trained_context"]) if r["trained_context"] else "",
                      memory.tokens_label(r["fits"]) if r["fits"] else "", path)
    out = render.console()
    out.print(table)
    if not rows:
        out.print("no models found in: " + "; ".join(places()))
