"""Benchmarks: decode speed against context length, and others built on the rooms."""
from __future__ import annotations

import os

from ktlong import OMP_SET, PEER


def peer_env() -> dict[str, str]:
    """The environment for a peer runtime's worker (llama.cpp): the user's, without the OpenMP
    settings ktlong sets for its own kernels. llama.cpp's OpenMP barriers run between every op of
    a token; with ktlong's passive wait policy each one wakes a sleeping thread, and llama.cpp
    decoded Gemma 3 270M at half its speed on two threads (ktlong's, where a process imports
    ktlong, are set again unless PEER says not to)."""
    env = dict(os.environ)
    for name in env.pop(OMP_SET, "").split(","):
        env.pop(name, None)
    env[PEER] = "1"
    return env
