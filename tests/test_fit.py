"""Settings fitted to the model loaded: the sparse budget inside its trained context, max_seq_len
0 = what fits this model (ktlong/fit.py)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from ktlong import fit, memory
from ktlong.config import FIELDS, resolve_settings
from ktlong.spec import read_spec, trained_context

GB = 10**9
DEFAULT_STEP = 128 + 96 * 128 + 4096  # 16,512 tokens a step with the defaults


def fitted(model: Path, profile: str | None = None, free: int = 64 * GB, **over: object):
    res = resolve_settings(profile, over)  # config.yaml written on the way: the defaults
    return fit.fit_to_model(res, read_spec(model, need_weights=False), free_dram=free)


def test_an_8k_model_reads_inside_its_trained_context(shape_dir: Callable[..., Path]) -> None:
    r = fitted(shape_dir(max_position_embeddings=8192))
    st = r.settings
    assert fit.step_reads(st) <= 8192 * 3 // 4 and fit.window_reads(st) <= 8192 * 3 // 4
    assert (st.block_size, st.init_len) == (128, 128)  # kept; window and blocks shrink together
    assert (st.second_select_num, st.local_windows_len, st.prefill_window) == (43, 512, 6016)
    assert st.local_windows_len % st.block_size == 0 and st.question_blocks == 8
    for key in ("second_select_num", "local_windows_len", "prefill_window"):
        assert r.sources[key] == "fitted to the model's trained context 8,192"
    assert r.sources["init_len"].startswith("config:")
    assert [n.split(":")[0] for n in r.notes] == ["note"]


def test_a_windowed_prefill_chunk_stays_inside_the_trained_context(
        shape_dir: Callable[..., Path]) -> None:
    """CUDA's automatic 4,096-token chunk after a 6,144-token window would put keys 10K from a
    query of an 8K model: the chunk is cut to the room left; a chunk the user set stays."""
    spec = read_spec(shape_dir(max_position_embeddings=8192), need_weights=False)
    st = fit.fit_to_model(resolve_settings(None, {"prefill": "WINDOW"}), spec,
                          free_dram=64 * GB).settings
    assert fit.window_reads(st) == 6144
    assert fit.prefill_chunk(st, spec, cuda=True) == 2048
    assert fit.prefill_chunk(st, spec, cuda=False) == 1024  # already inside
    dense = dataclasses.replace(st, prefill="DENSE")
    assert fit.prefill_chunk(dense, spec, cuda=True) == 4096  # reads every key anyway
    assert fit.prefill_chunk(dataclasses.replace(st, chunk_size=4096), spec, cuda=True) == 4096
    long = dataclasses.replace(spec, max_positions=131072)
    assert fit.prefill_chunk(st, long, cuda=True) == 4096


def test_a_model_trained_long_enough_keeps_the_defaults(shape_dir: Callable[..., Path]) -> None:
    r = fitted(shape_dir(max_position_embeddings=32768))  # Gemma 3 270M's trained context
    assert fit.step_reads(r.settings) == DEFAULT_STEP and r.settings.prefill_window == 16384
    assert not r.notes and not any(s.startswith("fitted") for s in r.sources.values())


def test_rope_scaling_fits_to_the_original_length(shape_dir: Callable[..., Path]) -> None:
    yarn = shape_dir("yarn", max_position_embeddings=32768, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192})
    assert trained_context(read_spec(yarn)) == 8192
    assert fit.step_reads(fitted(yarn).settings) <= 6144
    llama3 = shape_dir("llama3", max_position_embeddings=131072, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192})
    assert trained_context(read_spec(llama3)) == 131072  # Llama 3.1 was trained at 128K


def test_values_the_user_set_are_kept_with_one_warning(shape_dir: Callable[..., Path],
                                                       tmp_path: Path) -> None:
    model = shape_dir(max_position_embeddings=8192)
    mine = tmp_path / "wide.yaml"
    mine.write_text("local_windows_len: 8192\nprefill_window: 20480\n")
    r = fitted(model, str(mine))
    assert (r.settings.local_windows_len, r.settings.prefill_window) == (8192, 20480)
    assert r.settings.second_select_num == 96  # their keys already fill it: the rest stay
    warnings = [n for n in r.notes if n.startswith("warning:")]
    assert len(warnings) == 1 and len(r.notes) == 1
    assert f"local_windows_len 8,192 from profile:{mine}" in warnings[0]
    assert "past the model's trained context (8,192 tokens)" in warnings[0]
    # a profile's own value inside the budget: kept, the others fit around it, no warning
    r = fitted(model, "infllm")
    assert r.settings.second_select_num == 16 and r.sources["second_select_num"] == \
        "profile:infllm"
    assert fit.step_reads(r.settings) <= 6144 and r.settings.local_windows_len == 3968
    assert not [n for n in r.notes if n.startswith("warning:")]
    # a flag always counts, even at the default's value; the default profile spells defaults out
    r = fitted(model, second_select_num=96)
    assert r.settings.second_select_num == 96 and len(r.notes) == 2
    assert fitted(model, "default").settings.second_select_num == 43
    assert fitted(model, "dense").settings.local_windows_len == 4096  # DENSE reads it all anyway


def test_max_seq_len_auto_fits_the_model_not_an_8b(shape_dir: Callable[..., Path]) -> None:
    free = 20 * GB
    tiny = shape_dir(num_hidden_layers=2, num_key_value_heads=1, num_attention_heads=4,
                     hidden_size=256, max_position_embeddings=8192)
    r = fitted(tiny, free=free)
    reference = memory.recommend_max_seq_len(memory.REFERENCE, "BF16", free)
    assert r.settings.max_seq_len == 1 << 20 > reference  # past its trained 8K, up to 1M
    assert r.sources["max_seq_len"].startswith("auto: what fits in free RAM (20 GB)")
    big = shape_dir("big")  # the 7B shape: its KV is what limits it
    assert fitted(big, free=free).settings.max_seq_len == memory.recommend_max_seq_len(
        read_spec(big), "BF16", free, cap=1 << 20) < 1 << 20
    assert fitted(tiny, "dense", free=free).settings.max_seq_len == 8192  # DENSE: its own max
    assert fitted(tiny, free=GB).settings.max_seq_len == fit.AUTO_FLOOR  # the preflight says more


def test_a_max_seq_len_the_user_wrote_is_kept(shape_dir: Callable[..., Path],
                                              ktlong_home: Path) -> None:
    ktlong_home.mkdir()
    (ktlong_home / "config.yaml").write_text("max_seq_len: 65536\n")
    r = fitted(shape_dir(max_position_embeddings=8192))
    assert r.settings.max_seq_len == 65536 and r.sources["max_seq_len"].startswith("config:")
    assert fitted(shape_dir("m2"), max_seq_len="32K").settings.max_seq_len == 32768


def test_explicit_is_about_who_set_it() -> None:
    res = resolve_settings("quest", {"top_k": 0}, config_file=False)
    assert fit.explicit(res, "block_size") and fit.explicit(res, "top_k")
    assert not fit.explicit(res, "prefill_window")
    assert not any(fit.explicit(res, k) for k in fit.BUDGET_KEYS if res.sources[k] == "default")
    assert FIELDS["max_seq_len"].default == 0


@pytest.mark.parametrize("name,trained", [("smollm2", 8192)])
def test_the_real_8k_model(name: str, trained: int) -> None:
    from ktlong.errors import KtlongError
    from ktlong.registry import resolve_model

    try:
        path = resolve_model(name)
    except KtlongError:
        pytest.skip(f"{name} is not installed")
    spec = read_spec(path)
    assert trained_context(spec) == trained
    r = fit.fit_to_model(resolve_settings(), spec, free_dram=64 * GB)
    assert fit.step_reads(r.settings) <= trained * 3 // 4 < r.settings.max_seq_len
