"""Answers measured on known models, quoted by memcheck beside the lengths they read with blocks.

A length past a model's trained context fits in memory long before the model reads it well:
memcheck says so with the figures `ktlong bench accuracy` gave on that model (the files in
docs/results/ hold the runs; the tests check these figures against them). A model is known by
its fingerprint (`ModelSpec.fingerprint`: the GGUF's tensors and metadata), not its file name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TASK_NAMES = {"passkey": "pass key", "needle": "needle", "kv": "key-value"}


@dataclass(frozen=True)
class Measured:
    model: str  # as the docs name it
    results: tuple[str, ...]  # the runs' files in docs/results/
    haystack: str  # bench accuracy's --haystack
    profile: str
    cells: tuple[tuple[str, int, int, int], ...]  # (task, length, right, asked)

    def line(self) -> str:
        """'pass key 9/10 at 4K, 1/10 at 16K; needle ...' in task order."""
        tasks = list(dict.fromkeys(t for t, *_ in self.cells))
        parts = []
        for task in tasks:
            got = [f"{r}/{n} at {_k(length)}" for t, length, r, n in self.cells if t == task]
            parts.append(f"{TASK_NAMES.get(task, task)} " + ", ".join(got))
        return "; ".join(parts)


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}"


def _cells(lengths: tuple[int, ...], **answers: str) -> tuple[tuple[str, int, int, int], ...]:
    """Cells from one "right/asked" per length for each task: passkey="9/10 8/10"."""
    out = []
    for task, text in answers.items():
        for length, cell in zip(lengths, text.split(), strict=True):
            right, asked = cell.split("/")
            out.append((task, length, int(right), int(asked)))
    return tuple(out)


MEASURED: dict[str, Measured] = {
    "d7967d3c7de85dcf": Measured(  # -m smollm2; 4K from the first run (read whole, as today),
        # the other lengths from the runs after it (a later file's cell replaces an earlier one's;
        # a run of another --seed adds its documents to it)
        "SmolLM2-135M-Instruct (Q4_1), trained at 8K",
        ("accuracy-smollm2-licenses.json", "accuracy-smollm2-licenses-default.json",
         "accuracy-smollm2-licenses-default-32k.json",
         "accuracy-smollm2-licenses-default-32k-seed1.json",
         "accuracy-smollm2-licenses-default-64k.json",
         "accuracy-smollm2-licenses-default-64k-seed1.json",
         "accuracy-smollm2-licenses-default-64k-seed2.json",
         "accuracy-smollm2-licenses-default-128k.json",
         "accuracy-smollm2-licenses-default-128k-seed1.json",
         "accuracy-smollm2-licenses-default-128k-seed2.json"), "licenses", "default",
        _cells((4096, 7168, 16384, 32768, 65536, 131072),
               passkey="9/10 10/10 9/10 10/10 9/10 3/5",
               needle="8/10 9/10 9/10 8/10 7/10 3/5")),
    "f08236ad06c52a7a": Measured(  # -m gemma3-270m
        "Gemma 3 270M (Q4_K_M), trained at 32K",
        # 16K is read whole; 32K was measured with the question's blocks voted at their own
        # distance and the question read once, 64K (the last file) as the default reads today
        ("accuracy-gemma3-16k.json", "accuracy-gemma3-32k.json", "accuracy-gemma3-64k.json",
         "accuracy-gemma3-64k-default.json"),
        "real", "default", _cells((16384, 32768, 65536), passkey="3/6 0/4 1/4",
                                  needle="6/6 4/4 4/4")),
}


def for_spec(spec: Any) -> Measured | None:
    """What was measured on this model, if anything."""
    fingerprint = getattr(spec, "fingerprint", None)
    return MEASURED.get(fingerprint) if isinstance(fingerprint, str) else None
