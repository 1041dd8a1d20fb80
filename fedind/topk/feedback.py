r"""Error feedback for top-k updates: what a site does not send now, it sends later.

Site, every round::

    ef = ErrorFeedback(mode="int8", threshold="exact")   # site state, checkpointed
    sparse = ef.compress(delta, ratio=0.01)              # delta = local - global weights
    record = to_record(encode(sparse))                   # fedind.topk.codec: ConfigRecord in the reply

:class:`ErrorFeedback` carries a residual (below); :class:`EstimateFeedback` (EF21) keeps
an estimate of the site's update that the server keeps too, and sends its sparse change.

Error feedback
--------------
All arrays of an update are treated as one vector: the top-k is over the whole model (or
shared between its arrays, :func:`~fedind.topk.selection.allocated_topk`). With
residual :math:`r_{t-1}` (zeros at first), update :math:`u_t`, ``k = max(1, round(ratio * N))``
over the :math:`N` coordinates of the model:

.. math::

    u'_t = u_t + r_{t-1}, \qquad
    s_t = Q\big(\mathrm{top}_k(u'_t)\big), \qquad
    r_t = u'_t - \hat s_t

where :math:`\mathrm{top}_k` keeps the ``k`` coordinates of largest magnitude (zeros are
never sent, so fewer than ``k`` go when fewer are non-zero), :math:`Q` quantises them and
:math:`\hat s_t` is the dense dequantised message — exactly what the server decodes. So the
residual absorbs the quantisation error as well as the unsent coordinates, and
:math:`\hat s_t + r_t = u_t + r_{t-1}` up to one float32 rounding of :math:`r_t` (for
``int8`` the subtraction is nearly always exact by Sterbenz' lemma, :math:`\hat s` being
within a factor 2 of :math:`u'`): nothing a site computes is lost, only delayed.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping

import numpy as np

from .selection import (
    ALLOCATIONS, MODES, THRESHOLDS, SparseTensor, allocated_topk, budget, quantise, sampled_topk_indices,
    topk_indices,
)

__all__ = ["ErrorFeedback", "EstimateFeedback", "decayed", "estimate_token"]


# --------------------------------------------------------------------------- error feedback


class ErrorFeedback:
    r"""Site-side top-k sparsification with error feedback (residual carried over rounds).

    .. math::

        u' = u + \gamma r, \qquad s = Q(\mathrm{top}_k(u')), \qquad r \leftarrow u' - \hat s

    with ``k = max(1, round(ratio * N))`` over all ``N`` coordinates of the update taken
    together (:func:`~fedind.topk.selection.budget`), chosen by ``allocation``
    (:func:`~fedind.topk.selection.allocated_topk`; ``"model"``: global top-k), ``Q`` the
    per-tensor quantiser of ``mode`` and :math:`\hat s`
    its dequantised value, so :math:`\hat s + r_{new} = u + \gamma r_{old}`.

    ``threshold="exact"`` selects with argpartition; ``"sampled"`` estimates the k-th
    magnitude from a random sample (:func:`sampled_topk_indices`: never more than ``k``
    coordinates, fewer with probability ~1e-4). Its random draws come from
    ``default_rng([seed, step])``, ``step`` counting calls to :meth:`compress` and saved in
    :meth:`state_dict`, so a restored site draws what it would have drawn.

    ``decay`` :math:`\gamma \in [0, 1]` scales the carried residual,
    :math:`u' = u + \gamma r` (1 = classic error feedback, nothing lost; 0 = plain top-k,
    no memory). Why less than 1 can help in federated learning: a site's update is the
    displacement of several local epochs from the current global model, not a gradient;
    when a coordinate is not sent, the next round's local training pushes it again from
    the same place, so a full residual counts that displacement twice.

    Residuals are float32, created lazily by the first :meth:`compress`; later updates must
    have the same array names and shapes.
    """

    def __init__(self, mode: str = "int8", threshold: str = "exact", seed: int = 0, decay: float = 1.0,
                 allocation: str = "model") -> None:
        if allocation not in ALLOCATIONS:
            raise ValueError(f"Invalid allocation value: {allocation!r} (expected one of {ALLOCATIONS})")
        if mode not in MODES:
            raise ValueError(f"Invalid mode value: {mode!r} (expected one of {MODES})")
        if threshold not in THRESHOLDS:
            raise ValueError(f"Invalid threshold value: {threshold!r} (expected one of {THRESHOLDS})")
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"Invalid seed value: {seed!r}")
        if isinstance(decay, bool) or not (isinstance(decay, (int, float, np.floating)) and 0 <= decay <= 1):
            raise ValueError(f"Invalid decay value: {decay!r} (expected 0 <= decay <= 1)")
        self.mode = mode
        self.allocation = allocation
        self.decay = float(decay)
        self.threshold = threshold
        self.seed = int(seed)
        self._residuals: dict[str, np.ndarray] = {}
        self._step = 0

    def compress(self, update: Mapping[str, np.ndarray], ratio: float) -> dict[str, SparseTensor]:
        """Sparsify and quantise ``update + residual``; keep what is not sent as residual.

        Returns one :class:`SparseTensor` per array of ``update`` (same order; arrays with
        nothing selected have ``count == 0``). The residuals change only if this succeeds.
        """
        if isinstance(ratio, bool) or not (isinstance(ratio, (int, float, np.floating)) and 0 < ratio <= 1):
            raise ValueError(f"Invalid ratio value: {ratio!r} (expected 0 < ratio <= 1)")
        if not isinstance(update, Mapping) or not update:
            raise ValueError("Invalid update: expected a non-empty mapping of name -> array")
        names = list(update)
        arrays = {}
        for name in names:
            a = np.asarray(update[name])
            if not np.issubdtype(a.dtype, np.floating):
                raise ValueError(
                    f"Invalid update[{name!r}]: dtype {a.dtype} is not floating (send integer buffers dense)"
                )
            if not np.all(np.isfinite(a)):
                raise ValueError(f"Invalid update[{name!r}]: non-finite values")
            arrays[name] = a
        if self._residuals:
            if set(names) != set(self._residuals):
                raise ValueError(f"Invalid update: names {sorted(names)} != residual names {sorted(self._residuals)}")
            for name in names:
                if arrays[name].shape != self._residuals[name].shape:
                    raise ValueError(
                        f"Invalid update[{name!r}]: shape {arrays[name].shape} "
                        f"!= residual shape {self._residuals[name].shape}"
                    )
        shapes = [arrays[n].shape for n in names]
        sizes = [math.prod(s) for s in shapes]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        total = int(offsets[-1])
        flat = np.empty(total, dtype=np.float32)
        for name, lo, hi in zip(names, offsets[:-1], offsets[1:]):
            flat[lo:hi] = arrays[name].ravel()
            if name in self._residuals:
                flat[lo:hi] += self.decay * self._residuals[name].ravel()
        if not np.all(np.isfinite(flat)):
            raise ValueError("Invalid update: update + residual overflows float32")

        k = budget(ratio, total)
        mag = np.abs(flat)
        if self.threshold == "exact":
            select = topk_indices
        else:
            rng = np.random.default_rng([self.seed, self._step])

            def select(m, n):
                return sampled_topk_indices(m, n, rng)
        selected = allocated_topk(mag, offsets, k, self.allocation, select)

        out: dict[str, SparseTensor] = {}
        bounds = np.searchsorted(selected, offsets)
        for i, name in enumerate(names):
            glob = selected[bounds[i] : bounds[i + 1]]
            codes, scale = quantise(flat[glob], self.mode)
            sparse = SparseTensor(shapes[i], glob - offsets[i], codes, scale, self.mode)
            flat[glob] -= sparse.values()  # residual absorbs quantisation error too
            out[name] = sparse
        self._residuals = {
            name: flat[lo:hi].reshape(shape)
            for name, shape, lo, hi in zip(names, shapes, offsets[:-1], offsets[1:])
        }
        self._step += 1
        return out

    def residual_norm(self) -> float:
        """L2 norm of all residuals together (0 before the first compress)."""
        return float(math.sqrt(sum(float(np.dot(r.ravel(), r.ravel())) for r in self._residuals.values())))

    def state_dict(self) -> dict:
        """``{"residuals": {name: float32 ndarray}, "step": int}`` (copies).
        Hyperparameters (mode, threshold, seed) come from the config."""
        return {"residuals": {k: v.copy() for k, v in self._residuals.items()}, "step": self._step}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore from :meth:`state_dict`; validates everything before changing ``self``.
        If residuals exist already, names and shapes must match them."""
        if not isinstance(state, Mapping) or set(state) != {"residuals", "step"}:
            keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"Invalid ErrorFeedback state keys: {keys}")
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"Invalid step in state: {step!r}")
        if not isinstance(state["residuals"], Mapping):
            raise ValueError("Invalid residuals in state: expected a mapping of name -> array")
        loaded = {}
        for name, r in state["residuals"].items():
            if not isinstance(name, str):
                raise ValueError(f"Invalid residual name: {name!r}")
            r = np.array(r, copy=True)
            if not np.issubdtype(r.dtype, np.floating) or not np.all(np.isfinite(r)):
                raise ValueError(f"Invalid residual {name!r}: expected finite floats")
            loaded[name] = r.astype(np.float32, copy=False)
        if self._residuals:
            if set(loaded) != set(self._residuals):
                raise ValueError(f"Invalid residual names: {sorted(loaded)} != {sorted(self._residuals)}")
            for name, r in loaded.items():
                if r.shape != self._residuals[name].shape:
                    raise ValueError(
                        f"Invalid residual {name!r}: shape {r.shape} != {self._residuals[name].shape}"
                    )
        self._residuals = loaded
        self._step = int(step)


def estimate_token(estimate: Mapping[str, np.ndarray]) -> str:
    """A 16-hex-digit fingerprint (SHA-256) of an estimate's names, shapes and float32
    bytes: site and server compare it to know they hold the same estimate; ``""`` for an
    empty one (nothing agreed yet)."""
    if not estimate:
        return ""
    digest = hashlib.sha256()
    for name in sorted(estimate):
        value = np.ascontiguousarray(estimate[name], dtype=np.float32)
        digest.update(json.dumps([name, list(value.shape)]).encode())
        digest.update(value.tobytes())
    return digest.hexdigest()[:16]


def decayed(estimate: Mapping[str, np.ndarray], decay: float) -> dict[str, np.ndarray]:
    """``decay * estimate`` in float32 (the same bits on the site and the server); the
    estimate itself when ``decay`` is 1."""
    if decay == 1.0:
        return dict(estimate)
    factor = np.float32(decay)
    return {name: (value * factor).astype(np.float32, copy=False) for name, value in estimate.items()}


class EstimateFeedback:
    r"""Site-side top-k with EF21 feedback (Richtárik, Sokolov, Fatkhullin 2021, "EF21: A
    New, Simpler, Theoretically Better, and Practically Faster Error Feedback").

    Site and server both keep an estimate :math:`g` of the site's update (zeros at first).
    Each round the site sends the compressed *change* of its update and both move the
    estimate by what was sent:

    .. math::

        s_t = Q\big(\mathrm{top}_k(u_t - g_{t-1})\big), \qquad g_t = g_{t-1} + \hat s_t

    and the server aggregates the dense :math:`g_t`, not the sparse :math:`\hat s_t`. Why it
    suits federated sites: a site's update (the displacement of its local epochs) changes
    slowly from round to round — same data, a global model that moved a little — so
    :math:`g` tracks it and the server averages a dense approximation of every site's
    update, where classic error feedback (:class:`ErrorFeedback`) averages sparse vectors
    and delays the rest. There is no residual: what was not sent is still in
    :math:`u - g` next round.

    ``decay`` :math:`\gamma`: the estimate carried into the next round is :math:`\gamma g`
    (:math:`s_t = Q(\mathrm{top}_k(u_t - \gamma g_{t-1}))`, :math:`g_t = \gamma g_{t-1} +
    \hat s_t`); 1 is EF21 as published. Below 1, a part of a site's update that the
    estimate no longer needs fades instead of being pushed every round until top-k gets to
    correcting it (the server applies the same factor).

    Agreement: both sides fingerprint the estimate (:func:`estimate_token`, bit-identical
    float32 arithmetic on both). The server sends the token it holds; when it is not this
    site's (``""`` after a server restart, a rejected or lost reply, a new site), the site
    starts again from :math:`g = 0`, and says so by returning ``""`` as the base it used.
    ``mode``, ``threshold`` and ``seed``: as for :class:`ErrorFeedback` (used with decay 0,
    i.e. a memoryless top-k compressor).
    """

    def __init__(self, mode: str = "int8", threshold: str = "exact", seed: int = 0, decay: float = 1.0,
                 allocation: str = "model") -> None:
        self._compressor = ErrorFeedback(mode=mode, threshold=threshold, seed=seed, decay=0.0, allocation=allocation)
        ErrorFeedback(decay=decay)  # validates decay
        self.decay = float(decay)
        self._estimate: dict[str, np.ndarray] = {}
        self.token = ""

    def compress(self, update: Mapping[str, np.ndarray], ratio: float,
                 server_token: str) -> tuple[dict[str, SparseTensor], str]:
        """``(sparse, base)``: the compressed ``update - estimate`` and the token of the
        estimate it is relative to (``""``: zeros, when ``server_token`` is not ours).
        The estimate and :attr:`token` move only if this succeeds."""
        base = self._estimate if (server_token and server_token == self.token) else {}
        base = decayed(base, self.decay)
        if base:  # ErrorFeedback.compress validates the rest
            if not isinstance(update, Mapping) or set(update) != set(base) or any(
                np.shape(update[n]) != base[n].shape for n in base
            ):
                raise ValueError("Invalid update: names or shapes differ from the estimate's")
            update = {name: np.asarray(update[name], dtype=np.float32) - base[name] for name in update}
        sparse = self._compressor.compress(update, ratio)
        self._estimate = {
            name: (base[name] + t.to_dense()) if base else t.to_dense() for name, t in sparse.items()
        }
        used, self.token = (self.token if base else ""), estimate_token(self._estimate)
        return sparse, used

    def state_dict(self) -> dict:
        """``{"estimate": {name: float32 ndarray}, "step": int}`` (copies)."""
        return {"estimate": {k: v.copy() for k, v in self._estimate.items()},
                "step": self._compressor.state_dict()["step"]}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore from :meth:`state_dict`; validates everything before changing ``self``."""
        if not isinstance(state, Mapping) or set(state) != {"estimate", "step"}:
            keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"Invalid EstimateFeedback state keys: {keys}")
        if not isinstance(state["estimate"], Mapping):
            raise ValueError("Invalid estimate in state: expected a mapping of name -> array")
        loaded = {}
        for name, g in state["estimate"].items():
            g = np.array(g, copy=True)
            if not isinstance(name, str) or not np.issubdtype(g.dtype, np.floating) or not np.all(np.isfinite(g)):
                raise ValueError(f"Invalid estimate {name!r}: expected a name and finite floats")
            loaded[name] = g.astype(np.float32, copy=False)
        self._compressor.load_state_dict({"residuals": {}, "step": state["step"]})
        self._estimate, self.token = loaded, estimate_token(loaded)
