"""Trellis-coded quantization (TCQ) of rows of values: AlignPred's ``quant=trellis`` lattice.

The reconstruction points are the multiples of a fine step ``s``, split into four subsets ``D_j =
{(4i + j) s}``. An 8-state trellis walks along each row (one token's channels of one head and layer):
a state allows either the even multiples (``D0 + D2``) or the odd ones (``D1 + D3``), and the
parity of the stored index picks the subset and so the next state. The stored integer per value is
its index within the state's allowed points, whose spacing is ``2s``: it costs what a plain lattice
of step ``2s`` costs, while the Viterbi search over the row lowers the squared error by about 1 dB
(measured 0.98 dB on Gaussian rows, against 0.91 dB for the 4-state trellis), about 0.16 bit per
value at the same NRMSE. The decoder follows the trellis with one table lookup per value.

The trellis below was chosen by searching shift-register trellises (next state ``(s << 1) & 7 |
(parity ^ g(s))``, codebook a parity of ``s``'s bits) for the largest gain on Gaussian rows.
"""

from __future__ import annotations

import numpy as np

from kvbackend import fastquant

# next state by [state, index parity], and each state's points: even (0) or odd (1) multiples of the step
TRANSITIONS = np.array([[0, 1], [3, 2], [5, 4], [6, 7], [1, 0], [2, 3], [4, 5], [7, 6]], np.int64)
ODD = np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64)
STATES = len(ODD)


def _incoming() -> tuple[np.ndarray, np.ndarray]:
    """For each next state, its two incoming (previous state, subset j) edges: [S, 2] each."""
    prev, subset = [[] for _ in range(STATES)], [[] for _ in range(STATES)]
    for state in range(STATES):
        for parity in range(2):
            nxt = TRANSITIONS[state, parity]
            prev[nxt].append(state)
            subset[nxt].append(ODD[state] + 2 * parity)
    assert all(len(p) == 2 for p in prev), "every state of the trellis has two incoming edges"
    return np.array(prev, np.int64), np.array(subset, np.int64)


IN_STATE, IN_SUBSET = _incoming()


def quantize(rows: np.ndarray, step: float) -> tuple[np.ndarray, np.ndarray]:
    """(indices int64 [N, T], reconstruction float64 [N, T]) of ``rows`` [N, T], each row one trellis
    path from state 0 with the least squared error. Compiled where numba serves (the same float64
    operations, ties to the first edge: identical indices), numpy otherwise."""
    rows = np.ascontiguousarray(rows, np.float64)
    if fastquant._usable() and rows.size:
        index = np.empty(rows.shape, np.int64)
        if fastquant._run(_viterbi, rows, float(step), TRANSITIONS, ODD, IN_STATE, IN_SUBSET, index) is not fastquant._FAILED:
            return index, dequantize(index, step)
    return _quantize_numpy(rows, step)


def _quantize_numpy(rows: np.ndarray, step: float) -> tuple[np.ndarray, np.ndarray]:
    n, t = rows.shape
    y = rows / step
    cost = np.full((n, STATES), np.inf)
    cost[:, 0] = 0.0
    choice = np.empty((t, n, STATES), np.int8)
    offsets = np.arange(4, dtype=np.float64)
    points = np.empty((t, n, 4))
    for i in range(t):
        point = 4.0 * np.rint((y[:, i, None] - offsets) / 4.0) + offsets  # nearest point of each subset [N, 4]
        points[i] = point
        err = (y[:, i, None] - point) ** 2
        candidates = cost[:, IN_STATE] + err[:, IN_SUBSET]  # [N, S, 2]
        pick = candidates.argmin(-1)
        choice[i] = pick
        cost = np.take_along_axis(candidates, pick[..., None], -1)[..., 0]
    state = cost.argmin(1)
    rows_at = np.arange(n)
    index = np.empty((n, t), np.int64)
    for i in range(t - 1, -1, -1):
        pick = choice[i, rows_at, state]
        prev, subset = IN_STATE[state, pick], IN_SUBSET[state, pick]
        point = points[i, rows_at, subset].astype(np.int64)
        index[:, i] = (point - ODD[prev]) // 2
        state = prev
    return index, dequantize(index, step)


def dequantize(index: np.ndarray, step: float) -> np.ndarray:
    """float64 [N, T] reconstruction of trellis indices [N, T] (rows from state 0)."""
    if fastquant._usable() and index.size:
        out = np.empty(index.shape, np.float64)
        if fastquant._run(_follow, np.ascontiguousarray(index, np.int64), float(step), TRANSITIONS, ODD,
                          out) is not fastquant._FAILED:
            return out
    n, t = index.shape
    state = np.zeros(n, np.int64)
    out = np.empty((n, t), np.float64)
    for i in range(t):
        column = index[:, i].astype(np.int64)
        out[:, i] = 2 * column + ODD[state]
        state = TRANSITIONS[state, column & 1]
    return out * step


if fastquant.numba is not None:

    @fastquant._jit
    def _viterbi(rows, step, transitions, odd, in_state, in_subset, index):  # one row at a time, in place
        n, t = rows.shape
        states = odd.shape[0]
        cost = np.empty(states)
        new = np.empty(states)
        choice = np.empty((t, states), np.int8)
        points = np.empty((t, 4))
        for r in range(n):
            cost[:] = np.inf
            cost[0] = 0.0
            for i in range(t):
                y = rows[r, i] / step
                for j in range(4):
                    points[i, j] = 4.0 * np.rint((y - j) / 4.0) + j
                for s in range(states):
                    a = cost[in_state[s, 0]] + (y - points[i, in_subset[s, 0]]) ** 2
                    b = cost[in_state[s, 1]] + (y - points[i, in_subset[s, 1]]) ** 2
                    if b < a:
                        choice[i, s] = 1
                        new[s] = b
                    else:
                        choice[i, s] = 0
                        new[s] = a
                cost[:] = new
            state = 0
            for s in range(1, states):
                if cost[s] < cost[state]:
                    state = s
            for i in range(t - 1, -1, -1):
                pick = choice[i, state]
                prev = in_state[state, pick]
                index[r, i] = (np.int64(points[i, in_subset[state, pick]]) - odd[prev]) // 2
                state = prev

    @fastquant._jit
    def _follow(index, step, transitions, odd, out):
        n, t = index.shape
        for r in range(n):
            state = 0
            for i in range(t):
                k = index[r, i]
                out[r, i] = (2 * k + odd[state]) * step
                state = transitions[state, k & 1]
