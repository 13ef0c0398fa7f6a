"""`ktlong bench cuda`: its comparison, run CPU against CPU here (CI has no GPU), and its one
line without a GPU."""

from __future__ import annotations

import pytest
import torch

from ktlong.bench import cuda
from ktlong.cli import main


def test_agree_compares_answers_and_kv():
    rows = cuda.agree(archs=("llama",), cases=("dense", "locret"), n_tokens=700, n_new=4,
                      gpu="CPU", threads=1)
    assert [r["case"] for r in rows] == ["dense", "locret"]
    for r in rows:
        assert len(r["tokens"]) == 4
        for side in ("gpu_local", "cpu_local"):
            assert r[side]["same"] and r[side]["kv_err"] == 0.0 and r[side]["logit_err"] == 0.0
            assert not r[side]["local_on_gpu"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="says so only where there is no GPU")
def test_without_a_gpu_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "cuda"])
    assert e.value.code != 0
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "Traceback" not in err


def test_model_agree_on_a_real_model():
    from ktlong.registry import resolve_model

    rows = cuda.model_agree(resolve_model("smollm2"), n_tokens=600, n_new=4, threads=2, gpu="CPU")
    assert [r["case"] for r in rows] == ["dense", "default"]
    for r in rows:
        assert len(r["tokens"]) == 4 and r["text"]
        for side in ("gpu_local", "cpu_local"):
            assert r[side]["same"] and r[side]["common"] == 4 and r[side]["logit_err"] == 0.0


def test_timed_row_on_the_cpu():
    import dataclasses

    from ktlong.config import Settings
    from ktlong.model import load_model
    from tests.models import hf_model

    lm = load_model(hf_model("llama"), device="CPU", dtype="float32")
    row = cuda._timed(lm, dataclasses.replace(Settings(), kv_type="FP32", max_seq_len=4096),
                      [2 + i % 200 for i in range(600)])
    assert row["device"] == "CPU" and row["tokens"] == 600 and row["peak_gpu_bytes"] is None
    assert row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0
