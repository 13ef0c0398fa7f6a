"""The built-in demo: a small trained model (`model/`) and documents with hidden facts.

`ktlong chat --demo` needs neither a model nor a document: `prepare()` writes a generated document
(pass key, key-value records, a needle at random depths) under KTLONG_HOME/demo and returns it with
the shipped model folder and the questions worth asking.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MODEL_DIR = Path(__file__).parent / "model"
DEMO_TOKENS = 16384


@dataclass(frozen=True)
class Demo:
    model: Path
    document: Path
    questions: list[str]  # one per hidden fact kind
    n_tokens: int


def prepare(n_tokens: int = DEMO_TOKENS, seed: int = 0) -> Demo:
    """Write (once) the demo document of about `n_tokens` tokens; seed picks the hidden facts."""
    from ktlong.config import ktlong_home
    from ktlong.demo import tasks
    from ktlong.errors import KtlongError

    if not (MODEL_DIR / "config.json").exists():
        raise KtlongError(f"the demo model is missing from {MODEL_DIR}",
                          hint="train it: python -m ktlong.demo.train --seed 0")
    if n_tokens < 256:
        raise KtlongError(f"--demo-tokens {n_tokens}: the demo document needs at least 256 tokens")
    sample = tasks.demo_sample(seed, n_tokens)
    folder = ktlong_home() / "demo"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"document-{n_tokens}-seed{seed}.txt"
    if not path.exists() or path.read_text(encoding="utf-8") != sample.document:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(sample.document, encoding="utf-8")
        tmp.replace(path)
    return Demo(MODEL_DIR, path, [f.question for f in sample.asked], n_tokens)
