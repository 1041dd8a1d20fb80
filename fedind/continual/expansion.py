"""Growing the classifier head when a new fault class appears. Pure numpy, server side.

The model's head is ``logits = W h + b`` with ``W = head.weight [K, F]`` and
``b = head.bias [K]``; class ``k`` owns row ``k`` of both and nothing else in the model
depends on ``K``. Growing ``K -> K'`` appends rows ``K..K'-1`` and leaves rows ``0..K-1``
bit-identical, so the old logits of every input are unchanged (the features ``h`` do not
depend on ``K``).

New rows (:func:`expand_head`): the rows sites proposed for them (``new_rows``, see
:func:`fedind.continual.phases.fit_new_rows`), else ``W_new = 0`` and ``b_new = min(b_old)`` (or
``new_bias``).

* Zero weights, not random ones: the new logit is then the constant ``b_new``, the same for
  every input, so it cannot fire on old-class inputs by chance, and it is identical on
  every site and the server with no seed to share. Zero rows do not stall learning: the
  cross-entropy gradient of row ``k`` is ``(p_k - [y = k]) h``, non-zero as soon as a
  sample of class ``k`` is seen, and two new classes part as soon as their samples do
  (softmax regression, unlike a hidden layer, has no symmetry to break).
* ``b_new = min(b_old)``: the new class starts no more likely than the least likely old
  class would be without evidence (``h = 0``); on real inputs the old classes add
  ``W h``. It starts low, but not so low that a few local epochs cannot lift it (a
  bias of -30 would take the gradient ``(p - 1)`` of hundreds of steps to recover).

Other per-class arrays must follow the head (:func:`pad_head_rows`, new rows filled with a
constant, by default 0): EWC Fisher diagonals (0: new rows are not consolidated, they are
free to learn), EWC anchors (use :func:`expand_head`: with ``F = 0`` their value does not
matter), server momentum / Adam moments and a site's error-feedback residuals (0: no history
yet), and per-class label histograms (0 counts). A site's replay buffer grows with
:meth:`fedind.continual.replay.ReplayBuffer.expand_classes`; its logit adjustment is recomputed from
its histogram of the new length.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["HEAD_BIAS", "HEAD_WEIGHT", "expand_head", "head_classes", "pad_head_rows", "set_head_rows", "zero_head_rows"]

HEAD_WEIGHT = "head.weight"
HEAD_BIAS = "head.bias"


def head_classes(state: Mapping[str, np.ndarray], weight_key: str = HEAD_WEIGHT, bias_key: str = HEAD_BIAS) -> int:
    """Number of classes ``K`` of the head in ``state`` (checks ``weight [K, F]``, ``bias [K]``)."""
    for key in (weight_key, bias_key):
        if key not in state:
            raise ValueError(f"Invalid state: no {key!r} (keys: {sorted(state)})")
    weight, bias = np.asarray(state[weight_key]), np.asarray(state[bias_key])
    if weight.ndim != 2 or bias.shape != (weight.shape[0],):
        raise ValueError(
            f"Invalid head: {weight_key} {weight.shape} and {bias_key} {bias.shape} (expected [K, F] and [K])"
        )
    return int(weight.shape[0])


def _new_classes(value, old: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < old:
        raise ValueError(f"Invalid new_num_classes value: {value!r} (the head has {old}; classes cannot shrink)")
    return int(value)


def _pad(array: np.ndarray, rows: int, fill: float) -> np.ndarray:
    extra = np.full((rows - array.shape[0],) + array.shape[1:], fill, dtype=array.dtype)
    return np.concatenate([array, extra])


def expand_head(
    state: Mapping[str, np.ndarray],
    new_num_classes: int,
    *,
    new_bias: float | None = None,
    new_rows: Mapping[int, tuple[np.ndarray, float]] | None = None,
    weight_key: str = HEAD_WEIGHT,
    bias_key: str = HEAD_BIAS,
) -> dict[str, np.ndarray]:
    """``state`` with a head of ``new_num_classes`` rows: old rows copied bit for bit, new
    rows ``weight = 0``, ``bias = new_bias`` (default ``min`` of the old biases), except the
    classes in ``new_rows`` (``{class: (row [F], bias)}``), which get those; dtypes kept.
    Every other entry is passed through (the same array objects)."""
    old = head_classes(state, weight_key, bias_key)
    new = _new_classes(new_num_classes, old)
    weight, bias = np.asarray(state[weight_key]), np.asarray(state[bias_key])
    if not np.issubdtype(weight.dtype, np.floating) or not np.issubdtype(bias.dtype, np.floating):
        raise ValueError(f"Invalid head: dtypes {weight.dtype}, {bias.dtype} (expected floating)")
    if new_bias is None:
        new_bias = float(bias.min())
    if not np.isfinite(new_bias):
        raise ValueError(f"Invalid new_bias value: {new_bias!r}")
    out = dict(state)
    out[weight_key] = _pad(weight, new, 0.0)
    out[bias_key] = _pad(bias, new, new_bias)
    if new_rows:
        if any(not old <= k < new for k in new_rows):
            raise ValueError(f"Invalid new rows for classes {sorted(new_rows)}: only {old}..{new - 1} are new")
        out = set_head_rows(out, new_rows, weight_key=weight_key, bias_key=bias_key)
    return out


def set_head_rows(
    state: Mapping[str, np.ndarray],
    rows: Mapping[int, tuple[np.ndarray, float]],
    *,
    weight_key: str = HEAD_WEIGHT,
    bias_key: str = HEAD_BIAS,
) -> dict[str, np.ndarray]:
    """``state`` with the head rows of the classes in ``rows`` (``{class: (row [F], bias)}``)
    replaced; every other row bit-identical, dtypes kept, other entries passed through."""
    classes = head_classes(state, weight_key, bias_key)
    weight, bias = np.array(state[weight_key], copy=True), np.array(state[bias_key], copy=True)
    for k, (row, b) in rows.items():
        row = np.asarray(row)
        if not (0 <= k < classes) or row.shape != weight.shape[1:] or not (np.all(np.isfinite(row)) and np.isfinite(b)):
            raise ValueError(f"Invalid row for class {k!r}: shape {row.shape} (head {weight.shape})")
        weight[k], bias[k] = row, b
    return {**state, weight_key: weight, bias_key: bias}


def pad_head_rows(
    arrays: Mapping[str, np.ndarray],
    new_num_classes: int,
    *,
    fill: float = 0.0,
    keys: Sequence[str] = (HEAD_WEIGHT, HEAD_BIAS),
) -> dict[str, np.ndarray]:
    """Per-class arrays that follow the head (Fisher, moments, residuals): each of ``keys``
    present in ``arrays`` gets rows up to ``new_num_classes`` filled with ``fill`` (a lazily
    created buffer may lack them). Present keys must agree on their number of rows."""
    present = [k for k in keys if k in arrays]
    rows = {k: np.asarray(arrays[k]).shape[:1] for k in present}
    if any(r == () for r in rows.values()) or len(set(rows.values())) > 1:
        raise ValueError(f"Invalid arrays: head rows disagree or are missing: { {k: np.shape(arrays[k]) for k in present} }")
    out = dict(arrays)
    if not present:
        return out
    new = _new_classes(new_num_classes, rows[present[0]][0])
    if not np.isfinite(fill):
        raise ValueError(f"Invalid fill value: {fill!r}")
    for k in present:
        out[k] = _pad(np.asarray(arrays[k]), new, fill)
    return out


def zero_head_rows(
    arrays: Mapping[str, np.ndarray],
    classes,
    *,
    keys: Sequence[str] = (HEAD_WEIGHT, HEAD_BIAS),
) -> dict[str, np.ndarray]:
    """Per-class arrays that follow the head (momentum, moments) with the rows of ``classes``
    set to 0; other rows and entries unchanged (copies of the edited arrays only)."""
    out = dict(arrays)
    rows = [int(c) for c in classes]
    for k in keys:
        if k not in arrays:
            continue
        array = np.array(arrays[k], copy=True)
        if array.ndim == 0 or any(not 0 <= c < array.shape[0] for c in rows):
            raise ValueError(f"Invalid classes {rows} for {k!r} of shape {array.shape}")
        array[rows] = 0
        out[k] = array
    return out
