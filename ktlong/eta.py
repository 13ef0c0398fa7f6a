"""The time left to read a prompt, from how its chunks have gone so far.

A prompt token costs a fixed part (projections, MLP, norms) and a part that grows with the keys
its attention reads at its position p, keys(p): every earlier token (p), at most `reach` of them
under a windowed prefill (`config.window_reads`), or, read through MInference's patterns past
their dense start, the patterns' columns and diagonals and the last queries' estimate over all p
keys. So the time to read tokens [0, x) of a prompt that starts at position `start` is close to

    T(x) = a x + b K(x),   K(x) = sum over p in [start, start + x) of keys(p)

`Eta` fits a and b (least squares, no intercept) to the (seconds, tokens done) points the
progress callback gives and answers T(total) - T(done). A rate taken over the last seconds
(rich's own ETA) is wrong in both directions: too short while the early tokens read few keys,
and too short all through an exact prefill, whose tokens keep getting dearer.
"""
from __future__ import annotations

import math
import time
from typing import Any

MIN_POINTS = 3  # points (after the first) before a fit is trusted
SKIP_SHARE = 0.02  # the first 2% of a read: kernels loaded, pages touched; not fitted

# what a key read through MInference's patterns costs against one read densely (Gemma 3 270M at
# 30K, 2 threads, `ktlong bench eta`: per-token costs along the read): a column or diagonal key
# (lone diagonals, the index built per chunk), and a key the last queries' estimate reads
LINE_KEY, ESTIMATE_KEY = 2.2, 3.5
# keys(p) = c0 + c1 p from position p0 on, up to the next piece's p0: ((p0, c0, c1), ...)
Curve = tuple[tuple[float, float, float], ...]
EVERY = ((0.0, 0.0, 1.0),)  # every earlier token


def capped(reach: int) -> Curve:
    """Every earlier token up to `reach`, then `reach`."""
    return ((0.0, 0.0, 1.0), (float(reach), float(reach), 0.0))


def keys_curve(settings: Any, spec: Any, end: int) -> Curve:
    """keys(p) of a read that ends at position `end` under `settings` (see the module)."""
    from ktlong.config import window_reads

    s = settings
    if s.attention == "LOCRET":  # the store keeps at most this many
        return capped(s.locret_budget + s.locret_stabilisers)
    reach = window_reads(s)
    patterns = s.prefill == "MINFERENCE"
    if s.prefill == "AUTO":
        from ktlong.minference import auto_reach

        patterns = end <= auto_reach(spec, s)
    if patterns:
        from ktlong.fit import prefill_chunk
        from ktlong.minference import DENSE_BELOW, LAST_Q

        chunk = prefill_chunk(s, spec, False)
        lines = LINE_KEY * (s.prefill_vertical + s.prefill_slash)
        return ((0.0, 0.0, 1.0), (float(DENSE_BELOW), lines, ESTIMATE_KEY * LAST_Q / chunk))
    return capped(reach) if reach else EVERY


def keys_before(x: float, start: int, curve: Curve) -> float:
    """K(x): the keys tokens [start, start + x) read in all (keys(p) integrated over them)."""
    a, b, total = float(start), float(start + x), 0.0
    for i, (p0, c0, c1) in enumerate(curve):
        p1 = curve[i + 1][0] if i + 1 < len(curve) else math.inf
        lo, hi = max(a, p0), min(b, p1)
        if hi > lo:
            total += c0 * (hi - lo) + c1 * (hi * hi - lo * lo) / 2
    return total


class Eta:
    """Seconds left in a read that ends at position `end` (None: starts at 0), of `total`
    tokens as the progress callback tells (see the module)."""

    def __init__(self, curve: Curve = EVERY, end: int | None = None,
                 clock: Any = time.monotonic) -> None:
        self.curve, self.end, self.clock = curve, end, clock
        self.start = 0
        self.t0: float | None = None
        self.total = 0
        self.points: list[tuple[float, float, float]] = []  # (seconds, tokens, keys) since t0
        self.x0 = 0.0  # tokens done when fitting starts

    def update(self, done: int, total: int, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        self.total = total
        if self.end is not None:
            self.start = max(0, self.end - total)
        if self.t0 is None or done < self.x0 or (not self.points and done <= SKIP_SHARE * total):
            self.t0, self.x0, self.points = now, float(done), []
            return
        if self.points and done == self.points[-1][1] + self.x0:
            return
        self.points.append((now - self.t0, done - self.x0, self._keys(done) - self._keys(self.x0)))

    def _keys(self, x: float) -> float:
        return keys_before(x, self.start, self.curve)

    def fit(self) -> tuple[float, float] | None:
        """(a, b): seconds a token, seconds a key read; None before MIN_POINTS points."""
        if len(self.points) < MIN_POINTS:
            return None
        sxx = sxk = skk = sxt = skt = 0.0
        for t, x, k in self.points:
            sxx, sxk, skk = sxx + x * x, sxk + x * k, skk + k * k
            sxt, skt = sxt + x * t, skt + k * t
        det = sxx * skk - sxk * sxk
        if det > 1e-12 * sxx * skk:
            a, b = (sxt * skk - skt * sxk) / det, (skt * sxx - sxt * sxk) / det
            if a >= 0 and b >= 0:
                return a, b
        # one term only: the keys' share cannot be told apart yet, or came out negative
        return max(0.0, sxt / sxx), 0.0

    def remaining(self) -> float | None:
        """Seconds left, or None while too little is known."""
        ab = self.fit()
        if ab is None:
            return None
        a, b = ab
        x = self.points[-1][1] + self.x0
        left = a * (self.total - x) + b * (self._keys(self.total) - self._keys(x))
        return max(0.0, left) if math.isfinite(left) else None
