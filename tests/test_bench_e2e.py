"""`ktlong bench e2e` at a tiny context: JSON rows have the documented shape, and ktlong (dense
profile) and transformers, fed the same prompt ids, generate the same greedy token ids."""
from __future__ import annotations

import json

import pytest

from ktlong.bench import e2e

TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128)


def test_bench_e2e_json(capsys: pytest.CaptureFixture[str]) -> None:
    e2e.main([512], new_tokens=4, threads=1, as_json=True,
             runtimes=["ktlong-dense", "transformers", "llamacpp"], shape=TINY, decode_runs=2)
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == TINY and data["threads"] == 1 and data["new_tokens"] == 4
    assert data["decode_runs"] == 2
    rows = {r["runtime"]: r for r in data["rows"]}
    for name in ("ktlong-dense", "transformers"):
        r = rows[name]
        assert r["status"] == "ok" and r["context"] == 512 and r["new_tokens"] == 4
        for key in ("prefill_tok_s", "decode_tok_s", "prefill_s", "decode_s"):
            assert isinstance(r[key], float) and r[key] > 0
        assert r["peak_rss_bytes"] > r["weights_bytes"] > 0 and r["kv_bytes"] > 0
        assert len(r["out"]) == 4
        # each decode run re-feeds the prompt's last token, then decodes 3 more; the window from
        # the first token to the last holds 3 forwards in transformers, 2 in ktlong (it feeds a
        # token before yielding it, and never feeds the last)
        fed = 2 if name.startswith("ktlong") else 3
        assert [w[0] for w in r["windows"]] == [fed, fed] and len(r["decode_tok_s_runs"]) == 2
        assert min(r["decode_tok_s_runs"]) <= r["decode_tok_s"] <= max(r["decode_tok_s_runs"])
    assert rows["ktlong-dense"]["out"] == rows["transformers"]["out"]
    assert rows["ktlong-dense"]["same_ids_as_transformers"] == 4
    assert rows["ktlong-dense"]["attended_share"] == 1.0
    if "llamacpp" in rows:  # llama-cpp-python is an optional extra
        assert rows["llamacpp"]["status"] == "not installed"
    else:
        assert {"llamacpp-fa", "llamacpp-q8kv"} <= set(rows)
        best = max(x for p in ("llamacpp-fa", "llamacpp-q8kv") if rows[p]["status"] == "ok"
                   for x in rows[p]["decode_tok_s_runs"])  # q8kv: head_dim 16 has no Q8_0
        k = rows["ktlong-dense"]
        assert k["vs_llamacpp_best_beside"] == [pytest.approx(k["decode_tok_s"] / best)]


def test_bench_e2e_pairs_each_repeat_with_the_peers_beside_it() -> None:
    def row(*rates: float, status: str = "ok") -> dict:
        return {"status": status, "decode_tok_s_runs": list(rates)}

    raw = {("ktlong-default", 9): [row(10, 12, 30), row(20, 21, 22), row(5, 5, 5)],
           ("llamacpp-fa", 9): [row(8, 10, 9), row(25, 24, 23), row(1, status="failed")],
           ("llamacpp-nofa", 9): [row(11, 6, 6), row(10, 10, 10), row(1, status="failed")]}
    names = ["ktlong-default", "llamacpp-fa", "llamacpp-nofa"]
    # repeat 1: median 12 over the best peer run 11; repeat 2: 21 over 25; repeat 3: no peer ran
    assert e2e._beside_best(raw, names, "ktlong-default", 9) == [12 / 11, 21 / 25]
    assert e2e._beside_best(raw, names, "llamacpp-fa", 9) == []
    assert e2e._beside_best(raw, names[:1], "ktlong-default", 9) == []


def test_bench_e2e_unknown_runtime() -> None:
    from ktlong.errors import KtlongError

    with pytest.raises(KtlongError):
        e2e.main([512], runtimes=["vllm"], shape=TINY)


def test_bench_e2e_one_llamacpp_mode() -> None:
    assert e2e._expand(["llamacpp-nofa"], have_llamacpp=True) == ["llamacpp-nofa"]
    assert e2e._expand(["llamacpp"], have_llamacpp=True) == ["llamacpp-fa", "llamacpp-q8kv"]
    assert e2e._expand(["llamacpp-fa", "ktlong-default"], have_llamacpp=False) == [
        "ktlong-default"]


def test_bench_e2e_failed_worker_is_a_row() -> None:
    """A worker that dies (the OOM killer at a long context, say) gives a `failed` row saying
    why, so the other runtimes' rows are kept."""
    import subprocess

    killed = subprocess.CompletedProcess([], -9, "", "")
    row = e2e._parse(killed, "transformers", 131072)
    assert row == dict(runtime="transformers", context=131072, status="failed",
                       note="killed by signal 9 (out of memory?)")
    crashed = subprocess.CompletedProcess([], 1, "", "Traceback ...\nMemoryError: boom\n")
    assert e2e._parse(crashed, "llamacpp-fa", 512)["note"] == "MemoryError: boom"
    ok = subprocess.CompletedProcess([], 0, 'log\n{"status": "ok"}\n', "")
    assert e2e._parse(ok, "x", 1) == {"status": "ok"}


def test_bench_e2e_baseline_is_read_after_the_warm_up(monkeypatch, tmp_path) -> None:
    """The baseline is the worker's RSS once the runtime has run the tiny model: what it loads
    (code, compiled kernels, thread pools) is not charged to the benchmark model."""
    calls: list[str] = []
    monkeypatch.setattr(e2e, "_warm", lambda runtime, tiny, ids, threads, *kv: calls.append(
        f"warm {runtime} {tiny} {len(ids)}"))
    monkeypatch.setattr(e2e, "peak_rss", lambda reset=False: calls.append(f"rss {reset}") or 7)
    monkeypatch.setattr(e2e, "_run_ktlong", lambda *a: calls.append("run") or dict(
        t0=0.0, first=1.0, out=[5, 6], windows=[[1, 0.5]], weights_bytes=1, kv_bytes=1))
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(list(range(600))))
    row = e2e._worker("ktlong-default", "model", "model.gguf", str(ids), 2, 1, 1, "tiny")
    assert calls == ["warm ktlong-default tiny 600", "rss True", "run", "rss False"]
    assert row["baseline_rss_bytes"] == 7 and row["decode_tok_s"] == 2.0


def test_bench_e2e_kv_type_and_tier_reach_ktlong(ktlong_home, capsys) -> None:
    """--kv-type Q8_0 --kv-tier disk: ktlong's worker (a subprocess) keeps its KV as Q8_0 rows
    in the disk tier's file (made under cache_dir/tier and unlinked), and the JSON says so. The
    default profile: its warm-up's small budget must still hold the question's pinned blocks."""
    from ktlong.kernels import kvquant

    shape = dict(TINY, head_dim=32)  # Q8_0 needs head_dim % 32 == 0
    e2e.main([512], new_tokens=3, threads=1, as_json=True, runtimes=["ktlong-default"],
             shape=shape, decode_runs=1, kv_type="Q8_0", kv_tier="disk")
    data = json.loads(capsys.readouterr().out)
    assert data["kv_type"] == "Q8_0" and data["kv_tier"] == "disk"
    (row,) = data["rows"]
    assert row["status"] == "ok", row.get("note")
    assert row["kv_type"] == "Q8_0" and row["kv_tier"] == "disk"
    per_token = 2 * 2 * 2 * kvquant.row_bytes(3, 32)  # layers, KV heads, K and V: 36-byte rows
    assert row["kv_bytes"] % per_token == 0 and 512 <= row["kv_bytes"] // per_token <= 512 + 3
    tier = ktlong_home / "cache" / "tier"
    assert tier.is_dir() and list(tier.iterdir()) == []


def test_bench_e2e_cli_kv_options(monkeypatch) -> None:
    from typer.testing import CliRunner

    from ktlong.cli import app

    calls: list[tuple] = []
    monkeypatch.setattr(e2e, "main", lambda *a, **kw: calls.append((a, kw)))
    runner = CliRunner()
    r = runner.invoke(app, ["bench", "e2e", "--contexts", "1K", "--runtimes", "ktlong-default",
                            "--kv-type", "q4_0", "--kv-tier", "disk"])
    assert r.exit_code == 0, r.output
    kw = calls[-1][1]
    assert kw["kv_type"] == "Q4_0" and kw["kv_tier"] == "disk"
    assert kw["command"].endswith(" --kv-type Q4_0 --kv-tier disk")
    r = runner.invoke(app, ["bench", "e2e", "--contexts", "1K"])
    assert calls[-1][1]["kv_type"] == "BF16" and calls[-1][1]["kv_tier"] == "ram"
    assert "--kv-type BF16 --kv-tier ram" in calls[-1][1]["command"]
    for bad in (["--kv-type", "Q5_0"], ["--kv-tier", "auto"]):
        r = runner.invoke(app, ["bench", "e2e", "--contexts", "1K", *bad])
        assert r.exit_code == 2 and r.output.count("\n") == 1 and bad[1] in r.output
    assert len(calls) == 2


def test_bench_e2e_repeats_keep_every_run() -> None:
    """--repeats: the row's figures are medians over the repeats, and its runs are every
    repeat's (a repeat's own runs alone would hide the spread the median was taken over)."""
    rows = [dict(runtime="ktlong-default", prefill_s=1.0, prefill_tok_s=r, decode_s=1.0 / r,
                 decode_tok_s=r, peak_rss_bytes=1, baseline_rss_bytes=0,
                 decode_tok_s_runs=[r - 1, r, r + 1], windows=[[63, 63 / r]] * 3)
            for r in (30.0, 20.0, 25.0)]
    row = e2e._median_row(rows)
    assert row["decode_tok_s"] == 25.0 and row["prefill_tok_s"] == 25.0 and row["repeats"] == 3
    assert sorted(row["decode_tok_s_runs"]) == [19, 20, 21, 24, 25, 26, 29, 30, 31]
    assert len(row["windows"]) == 9
