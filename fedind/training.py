"""Local training and evaluation loops (CPU, or CUDA with bf16 autocast)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .data.format import SiteArrays


def pick_device(preference: str = "auto") -> torch.device:
    """``auto`` takes CUDA when present; ``cpu`` / ``cuda`` force it."""
    if preference not in ("auto", "cpu", "cuda"):
        raise ValueError(f"Invalid device: {preference!r} (auto, cpu or cuda)")
    if preference == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch sees no CUDA device")
    if preference == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(preference)


def cosine_lr(base_lr: float, progress: float, final_ratio: float = 0.02) -> float:
    """Cosine decay from ``base_lr`` (progress 0) to ``final_ratio * base_lr`` (progress 1)."""
    progress = min(max(progress, 0.0), 1.0)
    return base_lr * (final_ratio + (1 - final_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _autocast(device: torch.device):
    # bf16 needs no loss scaling; CPU runs in float32 for bit-exact determinism.
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


WEIGHT_DECAY = 1e-4  # of local SGD (and of a site's proposed rows for new classes, fedind.continual.phases)


def prior_logit_adjustment(histogram, tau: float = 1.0, floor: float = 1e-4) -> torch.Tensor:
    r"""Logit adjustment for training on a label-skewed site: :math:`\tau \log \pi`.

    :math:`\pi` is the site's label distribution (``histogram`` / total, classes it lacks
    get ``floor``). Training on ``logits + adjustment`` (balanced softmax, as in FedLC /
    logit-adjusted loss) lets the adjustment, not the model, carry the site's label prior:
    the local optimum is a model of :math:`p(x \mid y)`, so the head's bias does not learn
    "predict my frequent classes" and the classes a site never sees are not pushed down
    (their adjusted logits are ~:math:`\tau \log` ``floor``, so they get almost no
    gradient). Evaluation uses the plain logits. ``tau = 0`` gives zeros (plain
    cross-entropy).
    """
    counts = np.asarray(histogram, dtype=np.float64)
    if counts.ndim != 1 or counts.size < 1 or np.any(counts < 0) or not np.all(np.isfinite(counts)) or counts.sum() <= 0:
        raise ValueError(f"Invalid histogram: {histogram!r} (non-negative counts, not all zero)")
    if not (math.isfinite(tau) and tau >= 0):
        raise ValueError(f"Invalid tau value: {tau!r}")
    if not (0 < floor < 1):
        raise ValueError(f"Invalid floor value: {floor!r}")
    prior = np.maximum(counts / counts.sum(), floor)
    return torch.tensor(tau * np.log(prior), dtype=torch.float32)


def trained_label_counts(histogram, replay_histogram=None, replay_ratio: float = 0.0) -> np.ndarray:
    """Expected label counts of one epoch of :func:`train_local`'s loss: the new data's
    ``histogram`` plus, with replay, ``replay_ratio`` times its total spread as the replay
    buffer's label distribution (every batch of ``b`` new windows draws ``r * b`` windows
    uniformly from the buffer). This is the prior the logit adjustment must carry.

    With the new data's histogram alone, a replayed class absent from the new batch got the
    floor's adjustment (``0.5 log 1e-4 = -4.6``) on windows the loss does see, so training
    raised that class's plain logit by about as much, and a rare new class at the same line
    was never predicted (0 % on the continual benchmark's seed 2)."""
    counts = np.asarray(histogram, dtype=np.float64)
    if replay_histogram is None or replay_ratio == 0:
        return counts
    memory = np.asarray(replay_histogram, dtype=np.float64)
    if memory.shape != counts.shape or np.any(memory < 0) or not np.all(np.isfinite(memory)):
        raise ValueError(f"Invalid replay histogram: {replay_histogram!r} (non-negative, {counts.size} classes)")
    if not (math.isfinite(replay_ratio) and replay_ratio >= 0):
        raise ValueError(f"Invalid replay_ratio value: {replay_ratio!r}")
    if memory.sum() == 0:  # an empty buffer mixes nothing
        return counts
    return counts + replay_ratio * counts.sum() * memory / memory.sum()


class MomentumSGD:
    r"""``torch.optim.SGD(params, lr, momentum, weight_decay)`` (no dampening, no Nesterov),
    step for step the same numbers as its single-tensor path:

    .. math:: g \leftarrow \nabla + \lambda w, \quad b \leftarrow \mu b + g \; (b_1 = g),
              \quad w \leftarrow w - \gamma b

    Why not torch's: its first ``__init__`` / ``step`` imports ``torch._dynamo`` (with sympy),
    about 1.2 s of CPU in a fresh process and another 1.7 s at exit; a site agent starts a
    fresh process for every message (fedind.site.app, docs/deployment.md).
    """

    def __init__(self, params, lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        if not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not (math.isfinite(momentum) and momentum >= 0):
            raise ValueError(f"Invalid momentum value: {momentum}")
        if not (math.isfinite(weight_decay) and weight_decay >= 0):
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.buffers: list[torch.Tensor | None] = [None] * len(self.params)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            grad = p.grad.add(p, alpha=self.weight_decay) if self.weight_decay != 0 else p.grad
            if self.momentum != 0:
                if self.buffers[i] is None:
                    self.buffers[i] = grad.detach().clone()
                else:
                    self.buffers[i].mul_(self.momentum).add_(grad, alpha=1)
                grad = self.buffers[i]
            p.add_(grad, alpha=-self.lr)


@dataclass(frozen=True)
class TrainResult:
    loss: float  # mean training loss over the local steps
    steps: int


def train_local(
    model: nn.Module,
    data: SiteArrays,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
    device: torch.device,
    momentum: float = 0.9,
    weight_decay: float = WEIGHT_DECAY,
    proximal_mu: float = 0.0,
    logit_adjustment: torch.Tensor | None = None,
    replay: SiteArrays | None = None,
    replay_ratio: float = 0.0,
    penalty: Callable[[nn.Module], torch.Tensor] | None = None,
    grad_clip: float = 0.0,
    conditioned: torch.Tensor | None = None,
    trainable: Mapping[str, torch.Tensor] | None = None,
    stretch: float = 1.0,
) -> TrainResult:
    """SGD with momentum over ``epochs`` passes of ``data`` (shuffled with ``seed``).

    ``logit_adjustment`` (``[num_classes]``, e.g. :func:`prior_logit_adjustment`) is added
    to the logits of the training loss only; ``[N, num_classes]`` gives each of the ``N``
    examples of ``data`` its own row (pooled sites, each with its own prior; not with replay).

    ``proximal_mu > 0`` adds FedProx's ``mu/2 * ||w - w_global||^2`` to the loss, with
    ``w_global`` the weights the model had on entry.

    ``replay`` (e.g. ``ReplayBuffer.arrays()``) with ``replay_ratio = r > 0``: every batch of
    ``b`` new examples is extended by ``round(r * b)`` examples drawn uniformly, with
    replacement, from ``replay`` (a generator of its own, seeded from ``seed``: the order of
    the new data is the same as without replay); the loss is the mean over both, the logit
    adjustment applied to both. An empty ``replay`` (a buffer before its first admission)
    mixes nothing.

    ``penalty(model)`` (e.g. :class:`fedind.continual.ewc.EWCPenalty`) is added to the loss of every
    step, outside autocast.

    ``conditioned``: ``condition_windows(model, data.x)`` computed beforehand (a site's
    cache, :mod:`fedind.site.cache`); the steps are the same as without it.

    ``trainable``: boolean masks by parameter name (e.g. a sparse encrypted round's announced
    coordinates, :func:`fedind.paillier.sparse.coordinate_masks`): only those coordinates
    train. Gradients are masked before clipping, and after each step the other coordinates
    are put back to their values on entry (weight decay and momentum would move them). A
    parameter without a mask trains freely.

    ``stretch = r > 1``: every batch is time-scaled by a factor drawn log-uniformly from
    ``[1/r, r]`` (:func:`time_stretch`; a generator of its own, so the order and the replay
    draws are those without it): a line sees its faults at the speeds of other lines.

    With the defaults the steps are exactly those of plain training.
    """
    if isinstance(replay_ratio, bool) or not (isinstance(replay_ratio, (int, float)) and 0 <= replay_ratio < math.inf):
        raise ValueError(f"Invalid replay_ratio value: {replay_ratio!r} (expected a finite number >= 0)")
    if (replay is None) != (replay_ratio == 0):
        raise ValueError(
            f"replay and replay_ratio go together: got replay={'None' if replay is None else 'arrays'}, "
            f"replay_ratio={replay_ratio}"
        )
    if isinstance(stretch, bool) or not (isinstance(stretch, (int, float)) and 1.0 <= stretch < math.inf):
        raise ValueError(f"Invalid stretch value: {stretch!r} (expected a finite number >= 1; 1 = off)")
    if replay is not None and replay.num_examples and replay.sample_shape != data.sample_shape:
        raise ValueError(f"replay windows {replay.sample_shape} differ from the data's {data.sample_shape}")
    model.to(device).train()
    if conditioned is not None:
        if not hasattr(model, "condition") or len(conditioned) != data.num_examples:
            raise ValueError(
                f"conditioned windows {tuple(conditioned.shape)} do not fit the model and the "
                f"{data.num_examples} examples of data"
            )
        forward, x = model.classify, conditioned.to(device)
    else:
        forward, x = _split_front_end(model, torch.from_numpy(data.x).to(device))
    y = torch.from_numpy(data.y).to(device)
    mix = replay is not None and replay.num_examples > 0
    if mix:
        x_mem = _split_front_end(model, torch.from_numpy(replay.x).to(device))[1]
        y_mem = torch.from_numpy(replay.y).to(device)
        replay_generator = _side_generator(seed, 1)
    anchor = [p.detach().clone() for p in model.parameters()] if proximal_mu > 0 else None
    frozen = _frozen_coordinates(model, trainable, device) if trainable is not None else []
    optimizer = MomentumSGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    generator = torch.Generator().manual_seed(seed)
    stretch_generator = _side_generator(seed, 2) if stretch > 1.0 else None
    loss_fn = nn.CrossEntropyLoss()
    adjust = None if logit_adjustment is None else logit_adjustment.to(device)
    per_example = adjust is not None and adjust.ndim == 2
    if per_example and (adjust.shape[0] != len(data.y) or mix):
        raise ValueError(
            f"a per-example logit adjustment needs one row per example and no replay: "
            f"got {tuple(adjust.shape)} for {len(data.y)} examples, replay={'on' if mix else 'off'}"
        )
    total, steps = 0.0, 0
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=generator).to(device)
        for start in range(0, len(y), batch_size):
            batch = order[start : start + batch_size]
            xb, yb = x[batch], y[batch]
            if mix:
                pick = torch.randint(len(y_mem), (round(replay_ratio * len(batch)),), generator=replay_generator)
                pick = pick.to(device)
                xb, yb = torch.cat([xb, x_mem[pick]]), torch.cat([yb, y_mem[pick]])
            if stretch_generator is not None:
                draw = torch.rand(2, generator=stretch_generator)
                xb = time_stretch(xb, float(stretch ** (2 * draw[0] - 1)), float(draw[1]))
            with _autocast(device):
                logits = forward(xb)
                if adjust is not None:
                    logits = logits + (adjust[batch] if per_example else adjust)
                loss = loss_fn(logits, yb)
            if anchor is not None:
                prox = sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor))
                loss = loss + 0.5 * proximal_mu * prox
            if penalty is not None:
                loss = loss + penalty(model)
            optimizer.zero_grad()
            loss.backward()
            for p, keep, _ in frozen:
                if p.grad is not None:
                    p.grad.mul_(keep)
            if grad_clip > 0:
                nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            with torch.no_grad():
                for p, keep, start in frozen:
                    p.copy_(torch.where(keep, p, start))
            total += float(loss.detach())
            steps += 1
    return TrainResult(loss=total / max(steps, 1), steps=steps)


def _side_generator(seed: int, stream: int) -> torch.Generator:
    """A generator of its own for one kind of draw in :func:`train_local` (1: replay picks,
    2: time stretches), so turning one on leaves the other draws as they were."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence([seed, stream]).generate_state(1)[0]))


def time_stretch(x: torch.Tensor, factor: float, offset: float = 0.0) -> torch.Tensor:
    """Windows ``[B, C, L]`` played ``factor`` times slower (linear interpolation to
    ``round(L * factor)`` samples): a shaft, its fault rhythms and the resonance all slow by
    ``factor``, as on a line that runs slower or samples faster. Longer than ``L``: cut to
    ``L`` from ``offset`` (in [0, 1]) of the spare length; shorter: left short (the model
    pools over time). Applied to conditioned windows (:meth:`fedind.models.FaultCNN.condition`),
    it approximates conditioning the stretched recording: 10-20 % off on the raw channel,
    30-50 % on the whitened ones (linear interpolation smears and folds high frequencies).
    The exact, band-limited version was tried and not kept (docs/local-training.md)."""
    if not (math.isfinite(factor) and factor > 0) or not 0.0 <= offset <= 1.0:
        raise ValueError(f"Invalid time stretch: factor {factor!r}, offset {offset!r}")
    length = x.shape[-1]
    size = max(8, round(length * factor))
    if size == length:
        return x
    out = nn.functional.interpolate(x, size=size, mode="linear", align_corners=False)
    if size <= length:
        return out
    start = round(offset * (size - length))
    return out[..., start : start + length]


def _frozen_coordinates(
    model: nn.Module, trainable: Mapping[str, torch.Tensor], device: torch.device
) -> list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]]:
    """``(parameter, its boolean mask, its values on entry)`` of every masked parameter."""
    params = dict(model.named_parameters())
    unknown = sorted(set(trainable) - set(params))
    if unknown:
        raise ValueError(f"trainable masks for parameters the model lacks: {unknown}")
    out = []
    for name, mask in trainable.items():
        p = params[name]
        if tuple(mask.shape) != tuple(p.shape) or mask.dtype != torch.bool:
            raise ValueError(f"trainable mask of {name}: {mask.dtype}{tuple(mask.shape)}, expected bool{tuple(p.shape)}")
        out.append((p, mask.to(device), p.detach().clone()))
    return out


@torch.no_grad()
def _split_front_end(model: nn.Module, x: torch.Tensor, chunk: int = 512) -> tuple[Callable, torch.Tensor]:
    """``(forward, inputs)`` for a training loop: a model with a fixed front end
    (:meth:`fedind.models.FaultCNN.condition`) gets its windows conditioned once here, in
    chunks, and trains ``classify`` on them: the same numbers as ``model(x)`` without
    recomputing the front end every batch and epoch. Any other model gets ``(model, x)``."""
    if not hasattr(model, "condition") or not len(x):  # (an FFT of no windows fails; no batch would run)
        return model, x
    return model.classify, condition_windows(model, x, chunk)


@torch.no_grad()
def condition_windows(model: nn.Module, x: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """``model.condition(x)`` in chunks of ``chunk`` windows (bounded memory): the windows
    :meth:`fedind.models.FaultCNN.classify` trains on."""
    return torch.cat([model.condition(x[i : i + chunk]) for i in range(0, len(x), chunk)])


@torch.no_grad()
def window_features(model: nn.Module, windows: np.ndarray, device: torch.device, batch: int = 256) -> np.ndarray:
    """The features the head sees (``model.features``) of ``windows``, ``[N, F]`` float64, in
    eval mode (its train/eval mode restored): what a new class's row is fitted on
    (:func:`fedind.continual.phases.propose_new_rows`) and what head calibration takes
    moments of (:mod:`fedind.continual.calibration`)."""
    was_training = model.training
    model.to(device).eval()
    out = []
    for lo in range(0, len(windows), batch):
        x = torch.as_tensor(np.asarray(windows[lo:lo + batch]), dtype=torch.float32, device=device)
        out.append(model.features(x).double().cpu().numpy())
    model.train(was_training)
    return np.concatenate(out) if out else np.zeros((0, model.head.in_features))


@torch.no_grad()
def sample_losses(model: nn.Module, data: SiteArrays, device: torch.device, batch_size: int = 512) -> np.ndarray:
    """Cross-entropy of each example under ``model`` (float32 ``[N]``, plain logits, eval
    mode, left in eval mode): the importance score a :class:`fedind.continual.replay.ReplayBuffer`
    admits by."""
    model.to(device).eval()
    out = np.empty(data.num_examples, dtype=np.float32)
    for start in range(0, data.num_examples, batch_size):
        x = torch.from_numpy(data.x[start : start + batch_size]).to(device)
        y = torch.from_numpy(data.y[start : start + batch_size]).to(device)
        with _autocast(device):
            logits = model(x)
        losses = nn.functional.cross_entropy(logits.float(), y, reduction="none")
        out[start : start + len(y)] = losses.cpu().numpy()
    return out


@dataclass(frozen=True)
class EvalResult:
    loss: float
    accuracy: float
    num_examples: int
    confusion: np.ndarray  # [num_classes, num_classes], rows = true class


@torch.no_grad()
def evaluate(model: nn.Module, data: SiteArrays, device: torch.device, batch_size: int = 512) -> EvalResult:
    model.to(device).eval()
    num_classes = model.head.out_features
    confusion = np.zeros((num_classes, num_classes), dtype=np.int64)
    total_loss = 0.0
    for start in range(0, data.num_examples, batch_size):
        x = torch.from_numpy(data.x[start : start + batch_size]).to(device)
        y = torch.from_numpy(data.y[start : start + batch_size]).to(device)
        with _autocast(device):
            logits = model(x)
        total_loss += float(nn.functional.cross_entropy(logits.float(), y, reduction="sum"))
        pred = logits.argmax(dim=1).cpu().numpy()
        np.add.at(confusion, (data.y[start : start + batch_size], pred), 1)
    n = max(data.num_examples, 1)
    return EvalResult(
        loss=total_loss / n,
        accuracy=float(np.trace(confusion)) / n,
        num_examples=data.num_examples,
        confusion=confusion,
    )
