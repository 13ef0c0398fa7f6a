"""Real prose the project did not write, for benchmarks on real models.

Sources, all on any machine of this kind: the license texts Debian ships
(/usr/share/common-licenses) and Python's own documentation (the language reference topics that
`pydoc_data` carries, then the standard library's docstrings). Sections are shuffled by `seed`, so
documents of the same length differ, and each text is used once before any repeats.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from functools import cache
from pathlib import Path
from typing import Any

LICENSES = Path("/usr/share/common-licenses")


@cache
def sections(licenses_only: bool = False) -> tuple[str, ...]:
    """Every section of every source, in a fixed order (`licenses_only`: the license texts)."""
    out: list[str] = []
    if LICENSES.is_dir():
        for f in sorted(LICENSES.iterdir()):
            if f.is_file() and not f.is_symlink():
                out.append(f.read_text(errors="replace"))
    if licenses_only:
        return tuple(s.strip() for s in out if len(s.strip()) > 200)
    try:
        from pydoc_data.topics import topics

        out += [topics[k] for k in sorted(topics)]
    except ImportError:
        pass
    out += _docstrings()
    return tuple(s.strip() for s in out if len(s.strip()) > 200)


def _docstrings() -> list[str]:
    """Module docstrings of the standard library (its own documentation, in prose)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for f in sorted(lib.glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(f.read_text(errors="replace")))
        except (SyntaxError, ValueError):
            continue
        if doc:
            out.append(doc)
    return out


def text(tokenizer: Any, n_tokens: int, seed: int = 0) -> str:
    """About `n_tokens` tokens of prose (a little more: cut the ids, not the text)."""
    pool = list(sections())
    if not pool:
        raise FileNotFoundError(f"no prose found ({LICENSES} and pydoc_data are both missing)")
    rng = random.Random(seed)
    parts: list[str] = []
    have = 0
    while have < n_tokens:
        order = pool[:]
        rng.shuffle(order)
        for s in order:
            parts.append(s)
            have += len(tokenizer(s, add_special_tokens=False)["input_ids"])
            if have >= n_tokens:
                break
    return "\n\n".join(parts)


def ids(tokenizer: Any, n_tokens: int, seed: int = 0) -> list[int]:
    """Exactly `n_tokens` ids of prose."""
    out = tokenizer(text(tokenizer, n_tokens + 64, seed))["input_ids"]
    return out[:n_tokens]
