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
    # the runs in docs/results/: (file, the profile as that run named it; a profile file by its
    # file name, e.g. lw512.yaml for what later became the default)
    results: tuple[tuple[str, str], ...]
    haystack: str  # bench accuracy's --haystack
    profile: str  # the profile the cells are for, as a user names it
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
    "d7967d3c7de85dcf": Measured(  # -m smollm2; 4K read whole by any budget; the other lengths
        # from runs that named today's fitted budget by its file (lw512.yaml), beside the fit
        # before; 128K adds two documents read again under each setting (the -reads file).
        # A run of other documents adds them to a cell; a later run of a document replaces its
        # answers: the -firstblock runs read documents again with question_first_block, which
        # those runs' `default` has and lw512.yaml had not.
        "SmolLM2-135M-Instruct (Q4_1), trained at 8K",
        (("accuracy-smollm2-licenses.json", "default"),
         *((f"accuracy-smollm2-licenses-{n}-local512{tail}.json", "lw512.yaml") for n, tail in (
             ("7k", ""), ("16k", ""), ("32k", ""), ("32k", "-seed1"), ("64k", ""),
             ("64k", "-docs23"), ("64k", "-seed1"), ("64k", "-seed2"), ("128k", ""),
             ("128k", "-seed1"), ("128k", "-seed2"))),
         ("accuracy-smollm2-licenses-128k-misses-reads.json", "local_windows_len: 512"),
         *((f"accuracy-smollm2-licenses-{n}-firstblock{tail}.json", "default") for n, tail in (
             ("16k", ""), ("64k", "-seed1"), ("64k", "-seed2"), ("128k", ""), ("128k", "-seed1"),
             ("128k", "-seed2")))),
        "licenses", "default",
        _cells((4096, 7168, 16384, 32768, 65536, 131072),
               passkey="9/10 10/10 10/10 10/10 10/10 5/5",
               needle="8/10 9/10 9/10 9/10 9/10 4/5")),
    "f08236ad06c52a7a": Measured(  # -m gemma3-270m; 16K is read whole
        "Gemma 3 270M (Q4_K_M), trained at 32K",
        tuple((f"accuracy-gemma3-licenses-{n}.json", "default")
              for n in ("16k", "16k-docs4-9", "64k", "128k", "128k-docs5-9", "256k",
                        "256k-docs0-2", "256k-docs3-4")),
        "licenses", "default", _cells((16384, 65536, 131072, 262144),
                                      passkey="10/10 10/10 9/10 5/5",
                                      needle="9/10 10/10 10/10 4/5")),
}


def for_spec(spec: Any) -> Measured | None:
    """What was measured on this model, if anything."""
    fingerprint = getattr(spec, "fingerprint", None)
    return MEASURED.get(fingerprint) if isinstance(fingerprint, str) else None
