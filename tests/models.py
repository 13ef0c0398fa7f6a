"""Tiny random models shared by the tests, built once per session (no downloads)."""

from __future__ import annotations

import dataclasses
import tempfile
from functools import cache
from pathlib import Path

from ktlong.config import Settings
from ktlong.tinymodel import make_model, write_gguf

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
_ROOT = Path(tempfile.mkdtemp(prefix="ktlong-test-models-"))


@cache
def hf_model(arch: str = "llama", qk_scale: float = 1.0, **kw: object) -> Path:
    """An HF folder of a 2-layer GQA model (4 query heads, 2 KV heads, head_dim 16)."""
    name = f"{arch}-{qk_scale}-" + "-".join(f"{k}{v}" for k, v in sorted(kw.items()))
    return make_model(_ROOT / name, arch, seed=1, qk_scale=qk_scale, **kw)  # type: ignore[arg-type]


@cache
def gguf_model(arch: str = "llama", tensor_type: str = "F32") -> Path:
    folder = hf_model(arch)
    return write_gguf(folder, folder.parent / f"{folder.name}-{tensor_type}.gguf", tensor_type)


def settings(**kw: object) -> Settings:
    """Test settings: exact FP32 KV, small blocks and chunks so tiny prompts exercise everything."""
    base = dict(
        kv_type="FP32",
        block_size=16,
        init_len=16,
        local_windows_len=64,
        second_select_num=8,
        chunk_size=256,
        max_seq_len=8192,
        threads_num=2,
        preselect_block_count=16,
        question_blocks=0,  # tests that pin set it
        question_first_block=False,  # tests of the first block's second read set it
        question_votes="AS_IS",  # tests of votes taken as the blocks are read set NEAR
        block_positions="AS_IS",  # tests of compacted reads set COMPACT
        score_positions="AS_IS",  # tests of position-free scoring set NEAR
    )
    base.update(kw)
    return dataclasses.replace(Settings(), **base)  # type: ignore[arg-type]


def greedy_text(lm, st: Settings, ids: list[int], n: int) -> str:  # type: ignore[no-untyped-def]
    """The text of a fresh Session's greedy answer to `ids` (up to EOS or n tokens)."""
    from ktlong.engine import Sampling, Session

    s = Session(lm, st)
    s.prefill(ids)
    out = ""
    for step in s.generate(Sampling(max_new_tokens=n)):
        if step.token_id in lm.eos_ids:
            break
        out += step.text
    return out
