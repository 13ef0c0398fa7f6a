"""`ktlong bench ... --plot` and `ktlong bench plot`: each bench's figure from a small hand-made
result of the shape its --json prints; a saved result redraws; no matplotlib is one line, exit 2."""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

pytest.importorskip("matplotlib")

from ktlong.bench import cache, decode, e2e, prefill  # noqa: E402
from ktlong.bench import plot as plotting  # noqa: E402
from ktlong.cli import app  # noqa: E402
from ktlong.demo import accuracy  # noqa: E402

MACHINE = "Test CPU, 2 cores"


def _decode() -> dict[str, Any]:
    rows = [dict(context=n, sparse_ms=s, dense_ms=d, speedup=d / s)
            for n, s, d in ((16384, 0.9, 1.3), (65536, 1.0, 5.2), (1 << 20, 1.3, 84.0))]
    return {"bench": "decode", "command": "ktlong bench decode --contexts 16K,64K,1M",
            "machine": MACHINE, "threads": 2, "model": decode.MODEL, "repeats": 1,
            "bandwidth_gbps": 20.0, "anchors": "one", "rows": rows}


def _e2e() -> dict[str, Any]:
    rows = [dict(runtime=rt, context=n, status="ok", decode_tok_s=v / (1 + n / 65536))
            for n in (4096, 16384) for rt, v in (("ktlong-default", 20.0),
                                                 ("transformers", 5.0), ("llamacpp-fa", 24.0))]
    rows.append(dict(runtime="llamacpp-q8kv", context=16384, status="failed", note="boom"))
    return {"bench": "e2e", "command": "ktlong bench e2e --contexts 4K,16K",
            "machine": MACHINE, "threads": "2 (ktlong: idle cores)", "new_tokens": 64,
            "decode_runs": 3, "model": e2e.BENCH_SHAPE, "origin": "", "rows": rows}


def _accuracy() -> dict[str, Any]:
    records = []
    for length in (2048, 4096):
        for i in range(4):
            depths = accuracy.depths_for(i, 4)
            for task in ("passkey", "kv", "needle"):
                for profile in ("dense", "streamingllm"):
                    right = profile == "dense" or depths[task] > 0.75
                    records.append(dict(length=length, task=task, profile=profile,
                                        depth=round(depths[task], 3), correct=right,
                                        answer="42", attended=1.0))
    return {"bench": "accuracy", "command": "ktlong bench accuracy --lengths 2K,4K --samples 4",
            "machine": MACHINE, "threads": 2, "model": "ktlong's demo model", "records": records}


def _cache() -> dict[str, Any]:
    rows = [dict(context=n, prefill_ttft_s=p, hit_ttft_s=h, speedup=p / h, verify_s=0.01,
                 decode_mmap_tok_s=50.0, decode_ram_tok_s=51.0, hit_peak_rss_bytes=1 << 30)
            for n, p, h in ((32768, 12.0, 0.2), (131072, 95.0, 0.45))]
    return {"bench": "cache", "command": "ktlong bench cache --contexts 32768,131072",
            "machine": MACHINE, "threads": "auto (idle cores)", "model": cache.BENCH_SHAPE,
            "rows": rows}


def _prefill() -> dict[str, Any]:
    rows = [dict(runtime=rt, context=n, chunk_size=0 if rt == "transformers" else 4096,
                 prefill_tok_s=v * 8192 / n ** 0.9, prefill_s=1.0)
            for n in (8192, 32768)
            for rt, v in (("ktlong-dense", 900.0), ("ktlong-window", 950.0),
                          ("ktlong-minference", 920.0), ("transformers", 500.0))]
    return {"bench": "prefill", "command": "ktlong bench prefill --contexts 8K,32K",
            "machine": MACHINE, "threads": 2, "model": prefill.SHAPES["small"],
            "sampled_chunks": 0, "rows": rows}


# bench -> (result, the y label of its first panel, a phrase of its title)
CASES = {
    "decode": (_decode, "ms per decode step, one layer", "sparse vs dense"),
    "e2e": (_e2e, "decode tok/s", "decode speed against context"),
    "accuracy": (_accuracy, "dense\ndepth of the asked fact", "accuracy by length and depth"),
    "cache": (_cache, "time to first token (s, log scale)", "hit vs fresh prefill"),
    "prefill": (_prefill, "prefill tok/s", "prefill speed per mode"),
}


def _texts(fig: Any) -> str:
    return "\n".join(t.get_text() for t in fig.texts)


@pytest.mark.parametrize("bench", list(CASES))
def test_each_bench_draws_its_figure(bench: str, tmp_path: Path) -> None:
    make, ylabel, title = CASES[bench]
    data = make()
    png = tmp_path / f"{bench}.png"
    fig = importlib.import_module(plotting.MODULES[bench]).plot(data, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert fig.axes[0].get_ylabel() == ylabel
    assert {ax.get_xlabel() for ax in fig.axes} - {""} <= {"context (tokens)", "document tokens"}
    assert any(ax.get_xlabel() for ax in fig.axes)
    heading = fig._suptitle.get_text()
    assert title in heading and MACHINE in heading and "threads" in heading
    assert data["command"] in _texts(fig)  # the command, under the figure


def test_figures_have_what_they_show(tmp_path: Path) -> None:
    fig = decode.plot(_decode(), tmp_path / "d.png")
    ms = fig.axes[0]
    assert ms.get_xscale() == "log" and [t.get_text() for t in ms.get_xticklabels()] == [
        "16K", "64K", "1M"]
    assert {line.get_label() for line in ms.get_lines()} == {
        "sparse step (1 anchor per block)", "dense (fastest exact path)"}
    assert fig.axes[1].get_ylabel() == "tok/s (attention alone, 32 layers)"
    # e2e: failed rows are left out; every runtime that ran is a line
    labels = {line.get_label() for line in e2e.plot(_e2e(), tmp_path / "e.png").axes[0].get_lines()}
    assert labels == {"ktlong-default", "transformers", "llamacpp-fa"}
    # accuracy: a panel per task and profile, each cell's share written in it
    fig = accuracy.plot(_accuracy(), tmp_path / "a.png")
    panels = [ax for ax in fig.axes if ax.get_images()]
    assert len(panels) == 3 * 2
    assert [ax.get_title() for ax in panels[:3]] == ["passkey", "kv", "needle"]
    cells = [t.get_text() for t in panels[3].texts]  # streamingllm, passkey: 4 depths x 2 lengths
    assert len(cells) == 8 and set(cells) <= {"0", "100"} and "100" in cells and "0" in cells
    # cache: two bars per context, the speedup under them
    ax = cache.plot(_cache(), tmp_path / "c.png").axes[0]
    assert len(ax.patches) == 4
    assert [t.get_text() for t in ax.get_xticklabels()] == ["32K\nhit 60x faster",
                                                           "128K\nhit 211x faster"]
    lines = prefill.plot(_prefill(), tmp_path / "p.png").axes[0].get_lines()
    assert [line.get_label() for line in lines] == [
        "ktlong dense", "ktlong window", "ktlong minference", "transformers"]


@pytest.mark.parametrize("bench", list(CASES))
def test_bench_plot_redraws_a_saved_result(bench: str, tmp_path: Path) -> None:
    saved = tmp_path / "result.json"
    saved.write_text(json.dumps(CASES[bench][0]()) + "\n")
    png = tmp_path / "again.png"
    r = CliRunner().invoke(app, ["bench", "plot", str(saved), "--plot", str(png)])
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_bench_plot_refuses_what_it_cannot_draw(tmp_path: Path) -> None:
    runner = CliRunner()
    for text, why in (("{\"rows\": []}", "no \"bench\" key"),
                      ("{\"bench\": \"gemv\"}", "no figure for bench 'gemv'"),
                      ("not json", "not JSON")):
        saved = tmp_path / "r.json"
        saved.write_text(text)
        r = runner.invoke(app, ["bench", "plot", str(saved), "--plot", str(tmp_path / "x.png")])
        assert r.exit_code == 2 and why in r.output, r.output
    r = runner.invoke(app, ["bench", "plot", str(tmp_path / "nope.json"), "--plot", "x.png"])
    assert r.exit_code == 2 and "nope.json" in r.output
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("args", [
    ["decode", "--contexts", "16K"], ["prefill", "--contexts", "1K"], ["cache"],
    ["e2e", "--contexts", "1K"], ["accuracy", "--lengths", "1K"]])
def test_plot_without_matplotlib_is_one_line(args: list[str], monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    r = CliRunner().invoke(app, ["bench", *args, "--plot", str(tmp_path / "x.png")])
    assert r.exit_code == 2
    assert r.output.strip() == "error: --plot needs matplotlib: pip install 'ktlong[bench]'"
    saved = tmp_path / "r.json"
    saved.write_text(json.dumps(_decode()))
    r = CliRunner().invoke(app, ["bench", "plot", str(saved), "--plot", str(tmp_path / "x.png")])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "ktlong[bench]" in r.output


def test_png_is_a_hidden_alias_of_plot() -> None:
    runner = CliRunner()
    for bench in ("e2e", "accuracy"):
        text = runner.invoke(app, ["bench", bench, "--help"], env={"COLUMNS": "200"}).output
        assert "--plot" in text and "--png" not in text
    assert "redraw" in runner.invoke(app, ["bench", "--help"]).output.lower()


def test_json_names_its_bench(monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A real (tiny) decode bench: --json names the bench, machine and command, and the same
    dict drew the PNG."""
    monkeypatch.setattr(decode, "BANDWIDTH_BYTES", 8 << 20)
    monkeypatch.setattr(decode, "FLUSH_BYTES", 1 << 20)
    png = tmp_path / "d.png"
    decode.main(contexts=[20000, 1000], repeats=1, threads=1, as_json=True, plot_file=png,
                command="ktlong bench decode --contexts 1000,20000 --repeats 1 -t 1")
    data = json.loads(capsys.readouterr().out)
    assert data["bench"] == "decode" and data["machine"] and data["threads"] == 1
    assert data["command"].startswith("ktlong bench decode")
    assert png.stat().st_size > 20_000
    again = tmp_path / "again.png"
    plotting.draw(data, again)
    assert again.stat().st_size > 20_000


def test_several_accuracy_runs_are_drawn_as_one(tmp_path: Path, monkeypatch) -> None:
    """One run a length, drawn in one grid: every record of each, every command in the footer;
    runs of another model, or another bench, are refused in one line."""
    whole = _accuracy()
    files = []
    for length in (2048, 4096):
        run = dict(whole, records=[r for r in whole["records"] if r["length"] == length],
                   command=f"ktlong bench accuracy --lengths {length}")
        files.append(tmp_path / f"{length}.json")
        files[-1].write_text(json.dumps(run))
    drawn = []
    monkeypatch.setattr(accuracy, "plot", lambda data, path: drawn.append(data))
    r = CliRunner().invoke(app, ["bench", "plot", *map(str, files), "--plot", "x.png"])
    assert r.exit_code == 0, r.output
    assert drawn[0]["records"] == whole["records"]
    assert drawn[0]["command"] == ("ktlong bench accuracy --lengths 2048; "
                                   "ktlong bench accuracy --lengths 4096")
    for other, why in ((dict(whole, model="another"), "its model differs"),
                       (_cache(), "only bench accuracy results are drawn together")):
        files[1].write_text(json.dumps(other))
        r = CliRunner().invoke(app, ["bench", "plot", *map(str, files), "--plot", "x.png"])
        assert r.exit_code == 2 and why in r.output, r.output


def test_accuracy_runs_of_one_model_file_merge_across_machines() -> None:
    from ktlong.errors import KtlongError

    merge = plotting.merge
    a = {**_accuracy(), "model": "/site/SmolLM2.gguf", "machine": "AMD EPYC, 2 cores",
         "threads": 1, "haystack": "licenses"}
    b = {**_accuracy(), "model": "/tmp/m/SmolLM2.gguf", "machine": "Xeon, 16 cores",
         "threads": 16, "haystack": "licenses"}
    out = merge([a, b], ["a.json", "b.json"])
    assert out["machine"] == "AMD EPYC, 2 cores / Xeon, 16 cores" and out["threads"] == "1 / 16"
    assert len(out["records"]) == 2 * len(a["records"])
    with pytest.raises(KtlongError, match="its model differs"):
        merge([a, {**b, "model": "/tmp/m/Other.gguf"}], ["a.json", "b.json"])
