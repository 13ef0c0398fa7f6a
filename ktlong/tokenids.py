"""A session's token ids: a growable int32 array behind a list's interface.

A Python list of ids costs ~36 bytes a token (an 8-byte pointer and a 28-byte int object), which
at a million tokens is more than a LOCRET session's whole KV budget; here a token costs 4 bytes.
Reads, appends, truncation (`del ids[n:]`), comparison with a list, `+` and `np.asarray` work as
on a list; a slice, or a sum, is a list.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

_CHUNK = 4096  # ids turned into Python ints at a time while iterating


class TokenIds:
    __slots__ = ("_a", "_n")

    def __init__(self, ids: Iterable[int] | np.ndarray = ()) -> None:
        a = _int32(ids)
        self._a, self._n = a.copy(), a.size  # [capacity] int32; ids in [:_n]

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int | slice) -> Any:
        view = self._a[: self._n]
        if isinstance(i, slice):
            return view[i].tolist()
        return int(view[i])

    def __iter__(self) -> Iterator[int]:
        for a in range(0, self._n, _CHUNK):
            yield from self._a[a : min(self._n, a + _CHUNK)].tolist()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        view = self._a[: self._n]
        if dtype is not None:
            return view.astype(dtype)
        return view.copy() if copy else view

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (TokenIds, list, tuple, np.ndarray)):
            return len(other) == self._n and common_prefix(self, other) == self._n
        return NotImplemented

    __hash__ = None  # mutable, like a list

    def __add__(self, other: Iterable[int]) -> list[int]:
        return self.tolist() + list(other)

    def __radd__(self, other: Iterable[int]) -> list[int]:
        return list(other) + self.tolist()

    def __repr__(self) -> str:
        return f"TokenIds({self._n} ids)"

    def __delitem__(self, i: slice) -> None:
        """Only `del ids[n:]`: cut back to the first n."""
        if not isinstance(i, slice) or i.stop is not None or i.step not in (None, 1):
            raise TypeError("TokenIds deletes a tail only: del ids[n:]")
        self._n = len(range(self._n)[: i.start or 0])

    def append(self, token: int) -> None:
        self._grow(1)
        self._a[self._n] = token
        self._n += 1

    def extend(self, ids: Iterable[int] | np.ndarray) -> None:
        if type(ids) is list and len(ids) == 1:  # a decode step's token: no array made
            self.append(ids[0])
            return
        new = _int32(ids)
        self._grow(new.size)
        self._a[self._n : self._n + new.size] = new
        self._n += new.size

    def tolist(self) -> list[int]:
        return self._a[: self._n].tolist()

    def _grow(self, k: int) -> None:
        if self._n + k > self._a.size:
            a = np.empty(max(self._n + k, 2 * self._a.size, 64), np.int32)
            a[: self._n] = self._a[: self._n]
            self._a = a


def _int32(ids: Iterable[int] | np.ndarray) -> np.ndarray:
    if isinstance(ids, TokenIds):
        return np.asarray(ids)
    a = np.asarray(ids if isinstance(ids, np.ndarray | list | tuple) else list(ids))
    if a.size and (a.ndim != 1 or a.dtype.kind not in "iu"):
        raise TypeError(f"token ids must be integers, got {a.dtype} {a.shape}")
    return a.astype(np.int32, copy=False).reshape(-1)


def common_prefix(a: Any, b: Any) -> int:
    """How many leading ids two sequences (lists, arrays, TokenIds) share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n] if isinstance(a, (list, tuple)) else np.asarray(a)[:n], np.int64)
    y = np.asarray(b[:n] if isinstance(b, (list, tuple)) else np.asarray(b)[:n], np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n
