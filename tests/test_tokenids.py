"""TokenIds: a session's ids as an int32 array that behaves like the list it replaces."""

from __future__ import annotations

import numpy as np
import pytest

from ktlong.tokenids import TokenIds, common_prefix


def test_token_ids_behave_like_a_list():
    ref = [5, 9, 2]
    t = TokenIds(ref)
    for step in ([7], np.array([1, 3]), TokenIds([8]), range(4)):
        t.extend(step)
        ref.extend(list(step))
    t.append(11)
    ref.append(11)
    assert t == ref and list(t) == ref and t.tolist() == ref and len(t) == len(ref)
    assert t[2] == 2 and t[-1] == 11 and t[3:6] == ref[3:6] and t[::-2] == ref[::-2]
    assert isinstance(t[0], int) and isinstance(t[1:3], list)
    assert t != ref[:-1] and t != [*ref[:-1], 12]
    assert t + [1] == [*ref, 1] and [1] + t == [1, *ref]
    del t[6:]
    del ref[6:]
    assert t == ref
    del t[-2:]
    del ref[-2:]
    assert t == ref and bool(t) and not TokenIds() and TokenIds() == []
    with pytest.raises(TypeError, match="tail only"):
        del t[1:2]
    with pytest.raises(TypeError, match="integers"):
        TokenIds([0.5])


def test_token_ids_cost_4_bytes_each_and_iterate_in_order():
    n = 100_000
    t = TokenIds()
    for a in range(0, n, 777):  # appended a turn at a time
        t.extend(np.arange(a, min(n, a + 777)))
    assert np.asarray(t).dtype == np.int32 and np.asarray(t).nbytes == 4 * n
    copied = np.array(t, copy=True)
    copied[0] = -1
    assert t[0] == 0  # a copy asked for is one
    assert t._a.nbytes <= 2 * 4 * n  # the capacity at most doubles
    assert sum(1 for _ in t) == n and list(t)[-3:] == [n - 3, n - 2, n - 1]


def test_common_prefix():
    a = np.arange(10_000)
    b = a.copy()
    b[7_001] = -1
    assert common_prefix(TokenIds(a), b.tolist()) == 7_001
    assert common_prefix(a[:50], TokenIds(a)) == 50
    assert common_prefix([], [1]) == 0 and common_prefix([1, 2], (1, 2, 3)) == 2
