r"""Elastic weight consolidation (EWC) across the phases of a federated run.

**Penalty.** After a phase (a task, a regime, a set of fault classes) ends with the global
model :math:`\theta^*`, the Laplace approximation of the posterior over what was learnt is a
Gaussian around :math:`\theta^*` whose precision is :math:`N F` (Kirkpatrick et al. 2017),
:math:`F` the Fisher information and :math:`N` the number of samples. EWC keeps its
diagonal and adds to every later local loss

.. math::

    \Omega(\theta) = \frac{\lambda}{2} \sum_i F_i (\theta_i - \theta^*_i)^2,
    \qquad \frac{\partial \Omega}{\partial \theta_i} = \lambda F_i (\theta_i - \theta^*_i),

with :math:`\lambda` absorbing :math:`N` and the weight of the past against the present.
Coordinates the old data were sensitive to (large :math:`F_i`) are held near their anchors,
the others are free.

**Fisher** (:func:`diagonal_fisher`, per site, on its own data at the phase boundary).
``kind="true"`` (default) is the Fisher information proper, the expectation over the
model's own predictive distribution, taken exactly over the :math:`K` classes (no sampled
labels, so no Monte-Carlo noise):

.. math::

    F_i = \frac{1}{N} \sum_n \sum_{k=1}^{K} p_\theta(k \mid x_n)
          \left(\partial_{\theta_i} \log p_\theta(k \mid x_n)\right)^2 .

For a softmax output it equals the diagonal of the generalised Gauss-Newton matrix of the
cross-entropy, the positive semi-definite curvature the Laplace approximation calls for (for
a linear softmax model, the Hessian of the mean loss itself: ``tests/test_ewc.py`` checks
that). It costs :math:`K` backward passes per sample, ``K = 10`` here, once per phase on at
most ``max_samples`` samples. ``kind="empirical"`` uses the true label only,
:math:`F_i = \frac1N \sum_n (\partial_i \log p_\theta(y_n \mid x_n))^2`, one backward pass
per sample; it is not a curvature estimate in general (Kunstner et al. 2019): well-fit
samples contribute almost nothing, mislabelled ones a lot. Per-sample gradients come from
``torch.func`` (``vmap`` over the batch), in float32, the model in eval mode.

**Aggregation** (:func:`aggregate_fishers`, server). A site's :math:`F_s` is the mean over its
samples, so the Fisher of the union of the sites' data is the weighted mean
:math:`F = \sum_s n_s F_s / \sum_s n_s` with :math:`n_s` the site's number of examples (an
estimate from a subsample is still an estimate of the site's mean).

**Several phases** (:func:`merge_fisher`, online EWC, Schwarz et al. 2018): one penalty, not
one per phase. After phase :math:`t`,

.. math::

    F^{(t)} = \gamma F^{(t-1)} + F_{\text{phase } t}, \qquad \theta^{*(t)} = \theta_{\text{end of phase } t},

:math:`\gamma \in [0, 1]`; :math:`\gamma = 1` sums the precisions of all phases (the Bayesian
recursion of Huszár 2018), :math:`\gamma < 1` lets old phases fade geometrically.

:class:`EWCState` holds :math:`F` and :math:`\theta^*` on the server (strategy state, behind
``state_dict()``); sites receive both and train with ``penalty=EWCPenalty(F, θ*, λ)``.

**Server-side damping** (:func:`server_consolidation`, optional, ``ewc-server-lambda``
:math:`\kappa > 0`): after each aggregation the server also takes the proximal step of the
penalty, :math:`\theta \leftarrow \arg\min_\theta \frac12\|\theta - \theta_{agg}\|^2 +
\frac{\kappa}{2}\sum_i F_i(\theta_i - \theta^*_i)^2`, i.e. each coordinate's drift from its
anchor is damped by :math:`1 / (1 + \kappa F_i)`. It acts on what the sites' penalty acts on,
so the two add up; the benchmark measures whether that pays (README, *Continual learning*).
Under encryption the server holds the summed Fisher (:mod:`fedind.paillier.sums`), which is
all it needs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import math

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

from ..data.format import SiteArrays
from .expansion import expand_head, pad_head_rows

__all__ = [
    "FISHER_KINDS",
    "EWCPenalty",
    "EWCState",
    "aggregate_fishers",
    "diagonal_fisher",
    "ewc_penalty",
    "merge_fisher",
    "server_consolidation",
]

FISHER_KINDS = ("true", "empirical")

_STATE_KEYS = ("fisher", "anchors", "phases")


def _count(value, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"Invalid {name} value: {value!r} (expected an integer >= {minimum})")
    return int(value)


def _real(value, name: str, low: float, high: float = np.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"Invalid {name} value: {value!r}")
    value = float(value)
    if not (np.isfinite(value) and low <= value <= high):
        raise ValueError(f"Invalid {name} value: {value!r} (expected {low} <= {name} <= {high})")
    return value


# --------------------------------------------------------------------------- Fisher


def diagonal_fisher(
    model: nn.Module,
    data: SiteArrays,
    device: torch.device,
    *,
    kind: str = "true",
    max_samples: int = 512,
    batch_size: int = 32,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Diagonal Fisher of ``model`` on ``data`` (see the module doc for ``kind``): float32
    arrays keyed like ``model.named_parameters()`` (trainable ones). At most ``max_samples``
    examples, a subset drawn with ``seed`` when there are more. The model's parameters are
    not changed; its train/eval mode is restored."""
    if kind not in FISHER_KINDS:
        raise ValueError(f"Invalid kind value: {kind!r} (expected one of {FISHER_KINDS})")
    max_samples = _count(max_samples, "max_samples")
    batch_size = _count(batch_size, "batch_size")
    seed = _count(seed, "seed", 0)
    n = data.num_examples
    if n == 0:
        raise ValueError("cannot estimate a Fisher from 0 examples")
    idx = np.arange(n) if n <= max_samples else np.sort(np.random.default_rng(seed).choice(n, max_samples, replace=False))
    was_training = model.training
    model.to(device).eval()
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    buffers = {k: b.detach() for k, b in model.named_buffers()}

    def log_probs(p, x):
        logits = functional_call(model, (p, buffers), (x.unsqueeze(0),))
        logp = torch.log_softmax(logits.float(), dim=-1)[0]
        return logp, logp.detach()

    def true_label_log_prob(p, x, y):
        return log_probs(p, x)[0].gather(0, y.unsqueeze(0)).squeeze(0)

    per_class = vmap(jacrev(log_probs, has_aux=True), in_dims=(None, 0))
    per_label = vmap(grad(true_label_log_prob), in_dims=(None, 0, 0))
    totals = {k: np.zeros(p.shape, dtype=np.float64) for k, p in params.items()}
    try:
        with torch.no_grad():
            num_classes = model(torch.from_numpy(data.x[idx[:1]]).to(device)).shape[-1]
        if data.y.min() < 0 or data.y.max() >= num_classes:
            raise ValueError(f"labels must lie in [0, {num_classes}) for this model, got {data.y.min()}..{data.y.max()}")
        for start in range(0, len(idx), batch_size):
            sel = idx[start : start + batch_size]
            x = torch.from_numpy(data.x[sel]).to(device)
            if kind == "true":
                jac, logp = per_class(params, x)  # jac[name]: [B, K, *shape]
                prob = logp.exp()
                for name, j in jac.items():
                    w = prob.reshape(prob.shape + (1,) * (j.dim() - 2))
                    totals[name] += (w * j.square()).sum(dim=(0, 1)).double().cpu().numpy()
            else:
                g = per_label(params, x, torch.from_numpy(data.y[sel]).to(device))  # [B, *shape]
                for name, j in g.items():
                    totals[name] += j.square().sum(dim=0).double().cpu().numpy()
    finally:
        model.train(was_training)
    return {name: (t / len(idx)).astype(np.float32) for name, t in totals.items()}


# --------------------------------------------------------------------------- penalty


def _check_pair(fisher: Mapping, anchors: Mapping) -> None:
    if not isinstance(fisher, Mapping) or not fisher:
        raise ValueError("Invalid fisher: expected a non-empty mapping of name -> array")
    if not isinstance(anchors, Mapping) or set(anchors) != set(fisher):
        got = sorted(anchors) if isinstance(anchors, Mapping) else type(anchors).__name__
        raise ValueError(f"Invalid anchors: names {got} != fisher names {sorted(fisher)}")


def _float32_tensor(value) -> torch.Tensor:
    if torch.is_tensor(value):
        return value.detach().to(torch.float32).clone()
    return torch.from_numpy(np.array(value, dtype=np.float32))


class EWCPenalty:
    r"""``penalty(model)`` :math:`= \frac{\lambda}{2} \sum_i F_i (\theta_i - \theta^*_i)^2`
    over the parameters named in ``fisher``; a ``train_local(penalty=...)`` callable.

    ``fisher`` and ``anchors``: name -> array (numpy or torch), same names and shapes;
    ``F >= 0``. Kept as float32 tensors, moved to the parameters' device on first use.
    """

    def __init__(self, fisher: Mapping[str, np.ndarray], anchors: Mapping[str, np.ndarray], lam: float) -> None:
        _check_pair(fisher, anchors)
        self.lam = _real(lam, "lam", 0.0)
        self._terms: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name in fisher:
            f, a = _float32_tensor(fisher[name]), _float32_tensor(anchors[name])
            if f.shape != a.shape:
                raise ValueError(f"Invalid fisher/anchors {name!r}: shapes {tuple(f.shape)} != {tuple(a.shape)}")
            if not (torch.isfinite(f).all() and torch.isfinite(a).all()) or (f < 0).any():
                raise ValueError(f"Invalid fisher/anchors {name!r}: expected finite values and fisher >= 0")
            self._terms[name] = (f, a)

    def __call__(self, model: nn.Module) -> torch.Tensor:
        params = dict(model.named_parameters())
        total = None
        for name, (f, a) in self._terms.items():
            p = params.get(name)
            if p is None or p.shape != f.shape:
                found = "missing" if p is None else f"shape {tuple(p.shape)}"
                raise ValueError(
                    f"EWC term {name!r} {tuple(f.shape)} does not match the model ({found}); "
                    "expand the Fisher and anchors with the head"
                )
            if f.device != p.device:
                f, a = f.to(p.device), a.to(p.device)
                self._terms[name] = (f, a)
            term = (f * (p.float() - a).square()).sum()
            total = term if total is None else total + term
        return 0.5 * self.lam * total


def ewc_penalty(
    model: nn.Module, fisher: Mapping[str, np.ndarray], anchors: Mapping[str, np.ndarray], lam: float
) -> torch.Tensor:
    r""":math:`\frac{\lambda}{2} \sum_i F_i (\theta_i - \theta^*_i)^2` (differentiable in the
    model's parameters). For a training loop build one :class:`EWCPenalty` instead: it
    converts ``fisher`` and ``anchors`` once."""
    return EWCPenalty(fisher, anchors, lam)(model)


# --------------------------------------------------------------------------- server maths


def _fisher_arrays(fisher: Mapping, what: str) -> dict[str, np.ndarray]:
    if not isinstance(fisher, Mapping) or not fisher:
        raise ValueError(f"Invalid {what}: expected a non-empty mapping of name -> array")
    out = {}
    for name, f in fisher.items():
        f = np.asarray(f)
        if not np.issubdtype(f.dtype, np.floating) or not np.all(np.isfinite(f)) or np.any(f < 0):
            raise ValueError(f"Invalid {what}[{name!r}]: expected finite floats >= 0")
        out[name] = f
    return out


def aggregate_fishers(fishers: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> dict[str, np.ndarray]:
    r"""Weighted mean :math:`\sum_s w_s F_s / \sum_s w_s` per name (float64 sums, float32
    result). With ``w_s`` the sites' numbers of examples it is the Fisher of their pooled
    data. All sites must send the same names and shapes."""
    if isinstance(fishers, Mapping) or not isinstance(fishers, Sequence) or not fishers:
        raise ValueError("Invalid fishers: expected a non-empty sequence of name -> array mappings")
    sites = [_fisher_arrays(f, f"fishers[{s}]") for s, f in enumerate(fishers)]
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (len(sites),) or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"Invalid weights: {np.asarray(weights).tolist()} (one finite weight >= 0 per site, positive sum)")
    names = list(sites[0])
    for s, f in enumerate(sites[1:], start=1):
        if set(f) != set(names):
            raise ValueError(f"Invalid fishers[{s}]: names {sorted(f)} != {sorted(names)}")
        for name in names:
            if f[name].shape != sites[0][name].shape:
                raise ValueError(f"Invalid fishers[{s}][{name!r}]: shape {f[name].shape} != {sites[0][name].shape}")
    w = w / w.sum()
    out = {}
    for name in names:
        total = np.zeros(sites[0][name].shape, dtype=np.float64)
        for ws, f in zip(w, sites):
            total += ws * f[name]
        out[name] = total.astype(np.float32)
    return out


def merge_fisher(
    old: Mapping[str, np.ndarray] | None, new: Mapping[str, np.ndarray], gamma: float = 1.0
) -> dict[str, np.ndarray]:
    r"""Online EWC: :math:`F \leftarrow \gamma F_{old} + F_{new}` per name (float32); ``old``
    None (the first phase) gives ``new``. Names and shapes must match (grow ``old`` with
    :func:`fedind.continual.expansion.pad_head_rows` when the head grew)."""
    gamma = _real(gamma, "gamma", 0.0, 1.0)
    new = _fisher_arrays(new, "new fisher")
    if old is None:
        return {k: v.astype(np.float32) for k, v in new.items()}
    old = _fisher_arrays(old, "old fisher")
    if set(old) != set(new):
        raise ValueError(f"Invalid fishers: old names {sorted(old)} != new names {sorted(new)}")
    out = {}
    for name, f in new.items():
        if old[name].shape != f.shape:
            raise ValueError(
                f"Invalid fishers[{name!r}]: old shape {old[name].shape} != new {f.shape} "
                "(pad the old Fisher when the head grows)"
            )
        out[name] = (gamma * old[name].astype(np.float64) + f).astype(np.float32)
    return out


def focus(
    fisher: Mapping[str, np.ndarray], anchors: Mapping[str, np.ndarray], keep: float
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Consolidate only what the earlier phases taught most: keep the largest ``keep`` share
    of the Fisher's coordinates (over all arrays together), zero the rest, and zero the
    anchors wherever the Fisher is zero (there the penalty does not look at them). The
    penalty then holds the coordinates the old data were most sensitive to, and the
    records are sparse on the wire. ``keep = 1`` is plain EWC: both are returned unchanged."""
    keep = _real(keep, "keep", 0.0, 1.0)
    if keep == 1.0:
        return dict(fisher), dict(anchors)
    names = list(fisher)
    flat = np.concatenate([np.asarray(fisher[n], np.float32).ravel() for n in names]) if names else np.zeros(0)
    k = int(math.ceil(keep * flat.size))
    threshold = np.partition(flat, flat.size - k)[flat.size - k] if 0 < k < flat.size else (np.inf if k == 0 else -np.inf)
    kept_f, kept_a = {}, {}
    for name in names:
        f = np.asarray(fisher[name], np.float32)
        mask = (f >= threshold) & (f > 0)
        kept_f[name] = np.where(mask, f, np.float32(0)).astype(np.float32)
        kept_a[name] = np.where(mask, np.asarray(anchors[name], np.float32), np.float32(0)).astype(np.float32)
    return kept_f, kept_a


def server_consolidation(
    arrays: Mapping[str, np.ndarray],
    fisher: Mapping[str, np.ndarray],
    anchors: Mapping[str, np.ndarray],
    kappa: float,
) -> dict[str, np.ndarray]:
    r"""The proximal step of the EWC penalty, taken by the server on the aggregate:
    :math:`\theta_i \leftarrow \theta^*_i + (\theta_i - \theta^*_i) / (1 + \kappa F_i)`.

    Names without a Fisher pass through (the same objects); dtypes are kept. ``kappa = 0``
    or ``F_i = 0`` leaves a coordinate unchanged; a large :math:`\kappa F_i` holds it at its
    anchor."""
    kappa = _real(kappa, "kappa", 0.0)
    out = dict(arrays)
    for name, f in fisher.items():
        if name not in arrays or name not in anchors:
            raise ValueError(f"Invalid server consolidation: no array or anchor for {name!r}")
        theta = np.asarray(arrays[name])
        anchor = np.asarray(anchors[name], dtype=np.float64)
        if theta.shape != f.shape or anchor.shape != f.shape:
            raise ValueError(
                f"Invalid server consolidation for {name!r}: array {theta.shape}, Fisher {f.shape}, anchor {anchor.shape}"
            )
        damped = anchor + (theta.astype(np.float64) - anchor) / (1.0 + kappa * f.astype(np.float64))
        out[name] = damped.astype(theta.dtype)
    return out


class EWCState:
    """Server-side EWC state: the consolidated Fisher :math:`F` and anchors :math:`\\theta^*`
    (both name -> float32 array, empty before the first phase) and the number of phases.

    ``consolidate`` at each phase boundary; ``expand_classes`` when the head grows.
    """

    def __init__(self, gamma: float = 1.0, keep: float = 1.0) -> None:
        self.gamma = _real(gamma, "gamma", 0.0, 1.0)
        self.keep = _real(keep, "keep", 0.0, 1.0)
        self.fisher: dict[str, np.ndarray] = {}
        self.anchors: dict[str, np.ndarray] = {}
        self.phases = 0

    def consolidate(
        self,
        fishers: Sequence[Mapping[str, np.ndarray]],
        weights: Sequence[float],
        anchors: Mapping[str, np.ndarray],
    ) -> None:
        r"""End a phase: :math:`F \leftarrow \gamma F + \mathrm{aggregate}(F_s, w_s)`,
        :math:`\theta^* \leftarrow` ``anchors`` (the global model now; names of the Fisher
        are taken from it). Nothing changes if anything is invalid."""
        phase = aggregate_fishers(fishers, weights)
        fisher = merge_fisher(self.fisher or None, phase, self.gamma)
        missing = sorted(set(fisher) - set(anchors))
        if missing:
            raise ValueError(f"Invalid anchors: no arrays for {missing}")
        kept = {}
        for name, f in fisher.items():
            a = np.array(anchors[name], dtype=np.float32, copy=True)
            if a.shape != f.shape or not np.all(np.isfinite(a)):
                raise ValueError(f"Invalid anchors[{name!r}]: shape {a.shape} (Fisher {f.shape}) or non-finite values")
            kept[name] = a
        self.fisher, self.anchors = focus(fisher, kept, self.keep)
        self.phases += 1

    def expand_classes(self, new_num_classes: int, new_bias: float | None = None) -> None:
        """Grow the head rows: Fisher rows 0 (new classes unconstrained), anchor rows as
        :func:`fedind.continual.expansion.expand_head` (their value is irrelevant under F = 0)."""
        if not self.fisher:
            return
        fisher = pad_head_rows(self.fisher, new_num_classes, fill=0.0)
        anchors = expand_head(self.anchors, new_num_classes, new_bias=new_bias)
        if self.keep < 1:  # new rows have F = 0: their anchors are zeroed like every unkept one
            anchors = {n: np.where(fisher[n] > 0, a, np.float32(0)).astype(np.float32) for n, a in anchors.items()}
        self.fisher, self.anchors = fisher, anchors

    def state_dict(self) -> dict:
        """``{"fisher": {name: float32}, "anchors": {name: float32}, "phases": int}`` (copies).
        ``gamma`` comes from the config."""
        return {
            "fisher": {k: v.copy() for k, v in self.fisher.items()},
            "anchors": {k: v.copy() for k, v in self.anchors.items()},
            "phases": self.phases,
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore from :meth:`state_dict`; validates everything before changing ``self``."""
        if not isinstance(state, Mapping) or set(state) != set(_STATE_KEYS):
            keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"Invalid EWCState state keys: {keys} (expected {sorted(_STATE_KEYS)})")
        phases = _count(state["phases"], "phases", 0)
        fisher, anchors = state["fisher"], state["anchors"]
        if not isinstance(fisher, Mapping) or not isinstance(anchors, Mapping):
            raise ValueError("Invalid EWCState state: fisher and anchors must be mappings")
        if (phases == 0) != (not fisher) or set(fisher) != set(anchors):
            raise ValueError(
                f"Invalid EWCState state: {phases} phases with fisher names {sorted(fisher)} "
                f"and anchor names {sorted(anchors)}"
            )
        loaded_f, loaded_a = {}, {}
        for name in fisher:
            f, a = np.asarray(fisher[name]), np.asarray(anchors[name])
            if f.dtype != np.float32 or a.dtype != np.float32 or f.shape != a.shape:
                raise ValueError(
                    f"Invalid EWCState state {name!r}: fisher {f.dtype} {f.shape}, anchors {a.dtype} {a.shape} "
                    "(expected float32 of one shape)"
                )
            if not (np.all(np.isfinite(f)) and np.all(np.isfinite(a))) or np.any(f < 0):
                raise ValueError(f"Invalid EWCState state {name!r}: expected finite values and fisher >= 0")
            loaded_f[name], loaded_a[name] = f.copy(), a.copy()
        self.fisher, self.anchors, self.phases = loaded_f, loaded_a, phases
