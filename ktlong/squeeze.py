"""SqueezeAttention's layer budgets (Wang et al., 2024): fewer selected blocks where a layer
changes little, more where it changes much, the same total.

A layer's importance is how far its output hidden state moves from its input: the cosine of the
two, per token, averaged over the prompt (measured by the engine while it prefills; high = the
layer adds little). 1-D k-means puts the sparse layers (those from `dense_layer_num` on) in three
groups; the group of highest similarity keeps `squeeze_ratio` of `second_select_num` per step
and the blocks it frees go to the group of lowest similarity, so every step reads as many
selected blocks over all layers as with UNIFORM. A group of `layer_step` layers shares one
selection, so it is one unit here: its similarity is its layers' mean, its blocks count once per
layer. Plain functions; `selection.SelectionPolicy.set_layer_budgets` applies them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

N_GROUPS = 3  # as in the paper: a few special layers, important ones, the rest
IMPORTANT, MIDDLE, SQUEEZED, DENSE = 0, 1, 2, -1  # LayerBudgets.group values
GROUP_NAMES = {IMPORTANT: "important", MIDDLE: "middle", SQUEEZED: "squeezed", DENSE: "dense"}


def cosine_sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of cos(a_t, b_t) for hidden states `[1, C, hidden]`: a float64 scalar
    tensor on their device (no sync). A zero row counts as cosine 0."""
    a, b = a[0].float(), b[0].float()  # [C, hidden]
    dot = torch.einsum("td,td->t", a, b)
    den = torch.linalg.vector_norm(a, dim=-1) * torch.linalg.vector_norm(b, dim=-1)
    return (dot / den.clamp_min(1e-30)).sum(dtype=torch.float64)


def kmeans_1d(values: np.ndarray, k: int = N_GROUPS, iters: int = 100) -> np.ndarray:
    """Lloyd's k-means on scalars, centroids started at the quantiles (i + 0.5) / k: deterministic.

    Returns `[n]` int labels 0..m-1 numbered by ascending centroid, m <= k the clusters that hold
    a value (all values equal: m = 1). A value equally near two centroids joins the lower one.
    """
    x = np.asarray(values, np.float64).reshape(-1)
    if x.size == 0:
        return np.zeros(0, np.int64)
    c = np.quantile(x, (np.arange(k) + 0.5) / k)
    for _ in range(iters):
        lab = np.argmin(np.abs(x[:, None] - c[None, :]), axis=1)  # [n]; ties: first centroid
        new = np.array([x[lab == j].mean() if (lab == j).any() else c[j] for j in range(k)])
        if np.array_equal(new, c):
            break
        c = new
    used = sorted(set(lab.tolist()), key=lambda j: (c[j], j))
    remap = np.zeros(k, np.int64)
    remap[used] = np.arange(len(used))
    return remap[lab]


@dataclass
class LayerBudgets:
    k: list[int]  # selected blocks per step, per layer (dense layers: second_select_num, unused)
    group: list[int]  # IMPORTANT, MIDDLE, SQUEEZED, or DENSE for layers read densely


def uniform(n_layers: int, k: int, dense_layer_num: int = 0) -> LayerBudgets:
    return LayerBudgets([k] * n_layers,
                        [DENSE if i < dense_layer_num else MIDDLE for i in range(n_layers)])


def layer_budgets(sims: np.ndarray, k: int, ratio: float, dense_layer_num: int = 0,
                  layer_step: int = 1) -> LayerBudgets:
    """Per-layer budgets from each layer's mean input/output cosine `sims` `[n_layers]`.

    The squeezed group's units get floor(k * ratio); the blocks freed go to the important
    group's units, evenly per layer, a remainder one block per unit in order of importance.
    The total over sparse layers is n_sparse * k exactly when layer_step is 1 (with groups of
    layers, a remainder smaller than a group's size is left unspent). Fewer than two distinct
    unit similarities: UNIFORM.
    """
    n = len(sims)
    out = uniform(n, k, dense_layer_num)
    units: dict[int, list[int]] = {}  # unit (layer // layer_step) -> its sparse layers
    for layer in range(dense_layer_num, n):
        units.setdefault(layer // layer_step, []).append(layer)
    if len(units) < 2:
        return out
    ids = sorted(units)
    usim = np.array([float(np.mean([sims[i] for i in units[u]])) for u in ids])
    labels = kmeans_1d(usim)
    top = int(labels.max())
    if top == 0:
        return out
    group_of = {u: (IMPORTANT if lab == 0 else SQUEEZED if lab == top else MIDDLE)
                for u, lab in zip(ids, labels.tolist(), strict=True)}
    low = min(k, math.floor(k * ratio + 1e-9))
    weight = {u: len(units[u]) for u in ids}
    freed = sum(weight[u] for u in ids if group_of[u] == SQUEEZED) * (k - low)
    important = [u for u in ids if group_of[u] == IMPORTANT]
    per_layer, rest = divmod(freed, sum(weight[u] for u in important))
    budget = {u: low if g == SQUEEZED else k for u, g in group_of.items()}
    for u in important:
        budget[u] += per_layer
    # the remainder: one more block per layer of the most important units first
    for u in sorted(important, key=lambda u: (usim[ids.index(u)], u)):
        if weight[u] <= rest:
            budget[u] += 1
            rest -= weight[u]
    for u in ids:
        for layer in units[u]:
            out.k[layer], out.group[layer] = budget[u], group_of[u]
    return out
