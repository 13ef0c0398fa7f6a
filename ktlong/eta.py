"""The time left to read a prompt, from how its chunks have gone so far.

A prompt token costs a fixed part (projections, MLP, norms) and a part that grows with the keys
its attention reads at its position p, keys(p): every earlier token (p), at most `reach` of them
under a windowed prefill (`config.window_reads`), or, read through MInference's patterns past
their dense start, the patterns' columns and diagonals and the last queries' estimate over all p
keys. So the time to read tokens [0, x) of a prompt that starts at position `start` is close to

    T(x) = a x + b K(x),   K(x) = sum over p in [start, start + x) of keys(p)

`Eta` fits a and b to the steps between the (seconds, tokens done) points the progress callback
gives (least squares, a step that took far longer than the rest set aside) and answers
T(total) - T(done). A rate taken over the last seconds
(rich's own ETA) is wrong in both directions: too short while the early tokens read few keys,
and too short all through an exact prefill, whose tokens keep getting dearer.
"""
from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

STEP_TOKENS = 1024  # the CPU's prefill chunk (chunk_size 0)
MIN_STEPS = 3  # steps before a fit is trusted
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
        self._fitted: tuple[int, tuple[float, float] | None] = (-1, None)  # (points, fit)

    def update(self, done: int, total: int, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        self.total = total
        if self.end is not None:
            self.start = max(0, self.end - total)
        if self.t0 is None or done < self.x0 or (not self.points and done <= SKIP_SHARE * total):
            self.t0, self.x0, self.points = now, float(done), []
            self._fitted = (-1, None)
            return
        if self.points and done == self.points[-1][1] + self.x0:
            return
        self.points.append((now - self.t0, done - self.x0, self._keys(done) - self._keys(self.x0)))

    def _keys(self, x: float) -> float:
        return keys_before(x, self.start, self.curve)

    def fit(self) -> tuple[float, float] | None:
        """(a, b): seconds a token, seconds a key read; None before MIN_STEPS steps.

        Fitted to steps of at least STEP_TOKENS tokens (a 16th of a shorter read): the progress
        moves a layer at a time and layers cost unlike amounts (Gemma 3's global ones read the
        whole context), while a chunk's worth holds every layer once. Seconds ~ a tokens + b
        keys, least squares; then again without the steps whose cost a token lies far from the
        rest (more than 4 median deviations): a delay that came once (a kernel loaded, pages
        read in, another job for a moment) is one such step, and says nothing of the tokens to
        come."""
        cum = np.asarray([(0.0, 0.0, 0.0)] + self.points)  # [n, 3]: seconds, tokens, keys
        ends, last, step = [0], 0.0, min(STEP_TOKENS, max(1, self.total // 16))
        for i in range(1, len(cum)):  # steps of a chunk or more: every layer once in each
            if cum[i, 1] - last >= step:
                ends.append(i)
                last = cum[i, 1]
        if len(ends) <= MIN_STEPS:  # (ends holds the start too)
            return None
        pts = np.diff(cum[ends], axis=0)  # [steps, 3]: dt, dx, dk
        keep = np.ones(len(pts), bool)
        for _ in range(2):
            ab = _nonneg_lstsq(pts[keep, 1:], pts[keep, 0])
            per_token = (pts[:, 0] - pts[:, 1:] @ ab) / pts[:, 1]  # [n] residual a token
            dev = np.abs(per_token - np.median(per_token))
            keep = dev <= 4 * np.median(dev) + 1e-12
        return float(ab[0]), float(ab[1])

    def remaining(self) -> float | None:
        """Seconds left, or None while too little is known."""
        if self._fitted[0] != len(self.points):  # the bar asks ~10 times a second
            self._fitted = (len(self.points), self.fit())
        ab = self._fitted[1]
        if ab is None:
            return None
        a, b = ab
        x = self.points[-1][1] + self.x0
        left = a * (self.total - x) + b * (self._keys(self.total) - self._keys(x))
        return max(0.0, left) if math.isfinite(left) else None


def _nonneg_lstsq(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """[a, b] >= 0 minimising |x [a, b] - t| (x [n, 2]): both, else the better of one alone."""
    ab = np.linalg.lstsq(x, t, rcond=None)[0]
    if (ab >= 0).all():
        return ab
    best = np.zeros(2)
    for j in range(2):
        nn = float(x[:, j] @ x[:, j])
        c = max(0.0, float(x[:, j] @ t) / nn) if nn > 0 else 0.0
        cand = np.zeros(2)
        cand[j] = c
        if np.sum((x @ cand - t) ** 2) < np.sum((x @ best - t) ** 2) or not best.any():
            best = cand
    return best
