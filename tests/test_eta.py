"""The progress bar's time left (ktlong.eta) against reads whose cost is known."""
import pytest

from ktlong.eta import EVERY, Eta, capped, keys_before


def read_times(total, start, keys, a, b, chunk=256):
    """(seconds, done) after each chunk of a read costing a + b keys(p) a token."""
    t, out = 0.0, []
    for c0 in range(0, total, chunk):
        c1 = min(total, c0 + chunk)
        t += sum(a + b * keys(p) for p in range(start + c0, start + c1))
        out.append((t, c1))
    return out


PATTERNS = ((0.0, 0.0, 1.0), (4096.0, 3072.0, 1 / 16))  # dense, then columns + diagonals


def patterns(p):
    return p if p < 4096 else 3072 + p / 16


@pytest.mark.parametrize("curve,keys", [(EVERY, lambda p: p),
                                        (capped(6144), lambda p: min(p, 6144)),
                                        (PATTERNS, patterns)], ids=["every", "window", "patterns"])
@pytest.mark.parametrize("start", [0, 20_000])
def test_the_time_left_follows_the_cost_of_the_keys_read(curve, keys, start):
    total, a, b = 32_768, 2e-3, 1e-6  # attention 3x the rest at 6K keys
    times = read_times(total, start, keys, a, b)
    end = times[-1][0]
    eta = Eta(curve, start + total)
    eta.update(0, total, 0.0)
    for t, done in times[:-1]:
        eta.update(done, total, t)
        left = eta.remaining()
        if done >= 0.15 * total:  # shown once three chunks' worth of steps are read
            assert left == pytest.approx(end - t, rel=0.02)


def test_a_delay_that_came_once_does_not_tilt_the_time_left():
    total = 32_768
    times = read_times(total, 0, lambda p: min(p, 6144), 2e-3, 1e-6)
    times = [(t + (5.0 if d > 1500 else 0.0), d) for t, d in times]  # 5 s lost in one chunk
    end = times[-1][0]
    eta = Eta(capped(6144), total)
    eta.update(0, total, 0.0)
    for t, done in times[:-1]:
        eta.update(done, total, t)
        if done >= 0.3 * total:  # set aside once the other steps outnumber it
            assert eta.remaining() == pytest.approx(end - t, rel=0.02)


def test_a_rate_alone_would_miss_by_more_than_a_fifth():
    # the case the model is for: a window read judged by its first tenth's rate
    total, reach = 32_768, 6144
    times = read_times(total, 0, lambda p: min(p, reach), 2e-3, 1e-6)
    t, done = next((t, d) for t, d in times if d >= total // 10)
    by_rate = t / done * (total - done)
    assert by_rate < 0.8 * (times[-1][0] - t)


def test_noise_and_too_few_points():
    eta = Eta(EVERY, 1000)
    eta.update(0, 1000, 0.0)
    assert eta.remaining() is None
    for i, d in enumerate((100, 200, 300, 400), 1):
        eta.update(d, 1000, i * (1.1 if i % 2 else 0.9))
    left = eta.remaining()
    assert left is not None and 4.0 < left < 8.0


@pytest.mark.parametrize("curve,keys", [(EVERY, lambda p: p), (capped(30), lambda p: min(p, 30)),
                                        (PATTERNS, patterns)], ids=["every", "window", "patterns"])
def test_keys_before_integrates_the_keys_a_token_reads(curve, keys):
    for start, x in ((0, 100), (50, 100), (10, 100), (3000, 5000), (5000, 100)):
        n = 100_000  # midpoint sum of keys(p) over p in [start, start + x)
        want = sum(keys(start + (i + 0.5) * x / n) for i in range(n)) * x / n
        assert keys_before(x, start, curve) == pytest.approx(want, rel=1e-4)


def test_the_bar_shows_the_time_left_of_its_eta():
    from types import SimpleNamespace

    from ktlong.chatui import _Eta

    eta = Eta(EVERY, 4000)
    task = SimpleNamespace(fields={"eta": eta})
    assert _Eta().render(task).plain == "ETA -:--:--"
    for d in (0, 1000, 2000, 2500, 3000):
        eta.update(d, 4000, float(d) / 100)  # 10 ms a token, no keys' share
    assert _Eta().render(task).plain == "ETA 0:00:10"


def test_the_chat_reads_with_the_keys_of_its_settings():
    from types import SimpleNamespace

    from ktlong.config import Settings
    from ktlong.eta import keys_curve

    spec = SimpleNamespace(max_positions=32_768, rope_scaling=None)  # trained on 32K
    window = Settings(prefill="WINDOW", prefill_window=6016, init_len=128)
    assert keys_curve(window, spec, 30_000) == capped(6144)
    assert keys_curve(Settings(prefill="DENSE"), spec, 30_000) == EVERY
    locret = Settings(attention="LOCRET", locret_budget=4096, locret_stabilisers=512)
    assert keys_curve(locret, spec, 30_000) == capped(4608)
    auto = Settings(prefill="AUTO", prefill_window=6016, init_len=128)
    inside, past = keys_curve(auto, spec, 30_000), keys_curve(auto, spec, 60_000)
    assert inside[1][1] > auto.prefill_vertical + auto.prefill_slash  # through the patterns
    assert past == capped(6144)  # past the trained length: the window


def test_bench_eta_holds_the_chats_eta_against_its_read(tmp_path):
    """`ktlong bench eta` on the demo model: the chat's own read, every shown ETA held against
    the time that was left."""
    import json

    from typer.testing import CliRunner

    from ktlong.cli import app
    from ktlong.demo import MODEL_DIR

    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(open("/usr/share/common-licenses/GPL-3").read().split()[:6000]))
    r = CliRunner().invoke(app, ["bench", "eta", "-m", str(MODEL_DIR), "-f", str(doc), "-t", "1",
                                 "--set", "chunk_size=256", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["tokens"] > 5000 and res["read_s"] > 0
    shares = [row["at"] for row in res["at"]]
    assert shares == sorted(shares) and shares[0] == 0.10
    assert 0 < res["first_eta_at"] < 0.5  # after three chunks' worth of steps
    shown = [row for row in res["at"] if row["share"] >= res["first_eta_at"]]
    assert len(shown) >= 3
    for row in res["at"]:
        assert (row["eta_s"] is not None) == (row in shown) and row["left_s"] > 0
    for row in shown:
        assert row["eta_s"] >= 0
        assert row["error"] == pytest.approx(row["eta_s"] / row["left_s"] - 1)
    assert res["worst_error"] >= max(abs(row["error"]) for row in shown if row["at"] < 0.9)
    assert len(res["points"]) > 10
