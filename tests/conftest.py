"""Shared fixtures. Every test runs with its own empty KTLONG_HOME and no KTLONG_* variables."""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # Compiled Numba kernels are cached under KTLONG_HOME, which each test replaces: keep them in
    # pytest's cache folder instead so a test session does not recompile every kernel.
    cache = getattr(config, "cache", None)  # None with -p no:cacheprovider
    if "NUMBA_CACHE_DIR" not in os.environ and cache is not None:
        os.environ["NUMBA_CACHE_DIR"] = str(cache.mkdir("numba"))


@pytest.fixture(autouse=True)
def ktlong_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh home (not created yet) and no KTLONG_* settings from the caller's shell."""
    for var in list(os.environ):
        if var.startswith("KTLONG_"):
            monkeypatch.delenv(var)
    home = tmp_path / "ktlong-home"
    monkeypatch.setenv("KTLONG_HOME", str(home))
    return home


@pytest.fixture(autouse=True)
def fixed_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """`threads_num: 0` means the cores idle at that moment, and sums split by threads round
    differently: the suite reads 0 as the usable cores, so runs it compares bit for bit agree."""
    from ktlong import kernels

    monkeypatch.setattr(kernels, "auto_threads", kernels.threads.usable_cores)


@pytest.fixture
def shape_dir(tmp_path: Path) -> Callable[..., Path]:
    """Make an HF model folder with a given shape: config.json + one tiny safetensors file.

    Only metadata is real (memcheck never reads weights); defaults are InternLM2.5-7B's shape as
    a llama: 32 layers, 32 heads, 8 KV heads, head_dim 128, 256K positions.
    """

    def make(name: str = "model", **cfg: object) -> Path:
        import numpy as np
        from safetensors.numpy import save_file

        folder = tmp_path / name
        folder.mkdir()
        config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                  "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 92544,
                  "max_position_embeddings": 262144, "rope_theta": 50000000.0}
        config.update(cfg)
        (folder / "config.json").write_text(json.dumps(config))
        save_file({"lm_head.weight": np.zeros((4, 8), np.float32)},
                  str(folder / "model.safetensors"))
        return folder

    return make
