"""`bench prefill`'s worker on a tiny model, whole and sampled: the sampled estimate times only
the picked chunks (over a store filled with random K, V up to each) and scales them."""

from __future__ import annotations

import pytest

from ktlong.bench import prefill

from .models import hf_model


@pytest.mark.parametrize("mode", ["dense", "window", "minference"])
def test_sampled_prefill_fills_the_past_and_scales_the_chunks(mode):
    model = hf_model("llama")
    whole = prefill._worker(f"ktlong-{mode}", str(model), 2048, 1, 512, 0)
    sampled = prefill._worker(f"ktlong-{mode}", str(model), 2048, 1, 512, 2)
    for row in (whole, sampled):
        assert row["prefill"] == mode and row["context"] == 2048
        assert row["prefill_s"] > 0 and row["prefill_tok_s"] == pytest.approx(
            2048 / row["prefill_s"])
        assert 0 < row["attention_s"] <= row["prefill_s"]
    assert sampled["sampled_chunks"] == 2 and whole["sampled_chunks"] == 0
    # two of four chunks timed, times two: the same order of time as the whole prefill
    assert 0.2 < sampled["prefill_s"] / whole["prefill_s"] < 5
