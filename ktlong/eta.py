"""The time left to read a prompt, from how its chunks have gone so far.

A prompt token costs a fixed part (projections, MLP, norms) and a part that grows with the keys
its attention reads: every earlier token, or at most `reach` of them under a windowed prefill
(`config.window_reads`). So the time to read tokens [0, x) of a prompt that starts at position
`start` is close to

    T(x) = a x + b K(x),   K(x) = sum over p in [start, start + x) of min(p, reach)

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


def reach_of(settings: Any, spec: Any, end: int) -> int | None:
    """Keys a prompt token reads at most in a read that ends at position `end`: init_len +
    prefill_window under a window (or AUTO past the length it reads through patterns), None when
    every earlier token."""
    from ktlong.config import window_reads

    if settings.attention == "LOCRET":  # the store keeps at most this many
        return settings.locret_budget + settings.locret_stabilisers
    reach = window_reads(settings)
    if not reach:
        return None
    if settings.prefill == "AUTO":
        from ktlong.minference import auto_reach

        if end <= auto_reach(spec, settings):
            return None  # read through the patterns: a cost that grows with the context
    return reach


def keys_before(x: float, start: int, reach: int | None) -> float:
    """K(x): the keys tokens [start, start + x) read in all (each min(position, reach))."""
    a, b = float(start), float(start + x)
    if reach is None or b <= reach:
        return (b * b - a * a) / 2
    if a >= reach:
        return reach * (b - a)
    return (reach * reach - a * a) / 2 + reach * (b - reach)


class Eta:
    """Seconds left in a read that ends at position `end` (None: starts at 0), of `total`
    tokens as the progress callback tells (see the module)."""

    def __init__(self, reach: int | None = None, end: int | None = None,
                 clock: Any = time.monotonic) -> None:
        self.reach, self.end, self.clock = reach, end, clock
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
        return keys_before(x, self.start, self.reach)

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
