"""A model for the line's computer: int8 post-training static quantisation of a FaultCNN,
and a distilled smaller student, written as one TorchScript file that runs without fedind.

Static quantisation (eager mode, ``x86`` engine, per-channel int8 weights, histogram-free
default observers) quantises every trainable layer, GroupNorm included
(``QuantizedGroupNorm``); the parameter-free front end (standardise, difference, Hilbert
envelope: :class:`fedind.models.VibrationFrontEnd`) stays in float, since its FFT has no
int8 kernel. Activation ranges are calibrated on the site's own windows.

The file runs a faster front end than training's (:class:`EdgeFrontEnd`): the same
values up to float rounding, with the Hilbert transform as a real FFT pair (``rfft``, a
fixed mask, ``irfft``) and the three standardisations fused into one; the module is traced
for the window length and frozen (weights folded into the graph).

Distillation trains a narrower FaultCNN (``width``) on windows with the teacher's
softened logits as targets, plus the labels when known (Hinton et al. 2015):
``loss = a * CE(s, y) + (1 - a) * T^2 * KL(softmax(t / T) || softmax(s / T))``.
"""

from __future__ import annotations

import copy
import io
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.ao.quantization as tq
from torch import nn

from ..models import FaultCNN
from ..training import cosine_lr

ENGINE = "x86"


class QuantReadyCNN(nn.Module):
    """A copy of ``model`` with quantisation stubs around its trainable layers:
    float front end -> quantise -> int8 layers -> dequantise."""

    def __init__(self, model: FaultCNN) -> None:
        super().__init__()
        self.front = copy.deepcopy(model.features[0])
        self.quant = tq.QuantStub()
        layers = [copy.deepcopy(layer) for layer in list(model.features)[1:]]
        for layer in layers:
            if isinstance(layer, nn.ReLU):
                layer.inplace = False  # a quantised tensor is rewritten, not modified in place
        self.layers = nn.Sequential(*layers)
        self.head = copy.deepcopy(model.head)
        self.dequant = tq.DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.head(self.layers(self.quant(self.front(x)))))


@torch.no_grad()
def quantize_static(model: FaultCNN, calibration: np.ndarray, batch_size: int = 256) -> nn.Module:
    """The int8 model of ``model``, its activation ranges observed on ``calibration``
    (float32 [N, C, L], e.g. the site's own training windows)."""
    if len(calibration) == 0:
        raise ValueError("quantisation needs calibration windows, got none")
    if ENGINE not in torch.backends.quantized.supported_engines:
        raise ValueError(f"this torch has no {ENGINE!r} quantised engine ({torch.backends.quantized.supported_engines})")
    torch.backends.quantized.engine = ENGINE
    ready = QuantReadyCNN(model.eval()).eval()
    ready.qconfig = tq.get_default_qconfig(ENGINE)
    prepared = tq.prepare(ready)
    for start in range(0, len(calibration), batch_size):
        prepared(torch.from_numpy(calibration[start : start + batch_size]))
    return tq.convert(prepared).eval()


def distil(
    teacher: FaultCNN,
    x: np.ndarray,
    y: np.ndarray | None,
    *,
    width: int,
    epochs: int = 30,
    batch_size: int = 32,
    lr: float = 0.05,
    temperature: float = 4.0,
    label_weight: float = 0.5,
    seed: int = 0,
) -> FaultCNN:
    """A FaultCNN of ``width`` trained to match ``teacher`` on windows ``x`` (labels ``y``
    weighted by ``label_weight`` when given); SGD with momentum, cosine learning rate."""
    if not 0 <= label_weight <= 1 or temperature <= 0 or epochs < 1:
        raise ValueError(f"Invalid distillation settings: label_weight={label_weight}, "
                         f"temperature={temperature}, epochs={epochs}")
    teacher.eval()
    torch.manual_seed(seed)
    student = FaultCNN(in_channels=x.shape[1], num_classes=teacher.head.out_features, width=width)
    with torch.no_grad():
        z = torch.cat([teacher.condition(torch.from_numpy(x[i : i + 256])) for i in range(0, len(x), 256)])
        targets = torch.cat([teacher.classify(z[i : i + 256]) for i in range(0, len(z), 256)])
    labels = None if y is None else torch.from_numpy(y)
    alpha = label_weight if labels is not None else 0.0
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(student.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    student.train()
    for epoch in range(epochs):
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(lr, epoch / epochs)
        for batch in torch.randperm(len(z), generator=generator).split(batch_size):
            logits = student.classify(z[batch])
            soft = nn.functional.kl_div(
                nn.functional.log_softmax(logits / temperature, dim=1),
                nn.functional.softmax(targets[batch] / temperature, dim=1),
                reduction="batchmean",
            ) * temperature**2
            loss = (1 - alpha) * soft
            if alpha:
                loss = loss + alpha * nn.functional.cross_entropy(logits, labels[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return student.eval()


# --------------------------------------------------------------------------- the file for the line


class EdgeFrontEnd(nn.Module):
    """:class:`fedind.models.VibrationFrontEnd` for windows of ``length`` samples, computed
    faster and equal up to float rounding. The envelope ``|x + i H(x)|`` of the difference
    ``d`` is ``hypot(d, H(d))`` with the Hilbert transform ``H(d) = irfft(-i sign(k) rfft(d))``
    (two real FFTs of length L instead of two complex ones, no complex magnitude), and the
    three channels are standardised together: one mean, one variance, one division."""

    def __init__(self, length: int, eps: float = 1e-5) -> None:
        super().__init__()
        mask = torch.zeros(length // 2 + 1, dtype=torch.complex64)
        mask[1 : (length + 1) // 2] = -1j  # DC (and the Nyquist bin of an even length) -> 0
        self.register_buffer("mask", mask)
        self.length = length
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        diff = nn.functional.pad(x[..., 1:] - x[..., :-1], (1, 0))  # torch.diff with the first sample prepended
        hilbert = torch.fft.irfft(torch.fft.rfft(diff, dim=-1) * self.mask, n=self.length, dim=-1)
        z = torch.cat([x, diff, torch.hypot(diff, hilbert)], dim=1)
        centred = z - z.mean(dim=-1, keepdim=True)
        return centred / (torch.sqrt((centred * centred).mean(dim=-1, keepdim=True)) + self.eps)


class EdgeCNN(nn.Module):
    """A FaultCNN (float or quantised: :class:`QuantReadyCNN` after ``convert``) with
    :class:`EdgeFrontEnd` in place of its front end; the layers are shared, not copied."""

    def __init__(self, module: nn.Module, length: int) -> None:
        super().__init__()
        self.front = EdgeFrontEnd(length)
        if isinstance(module, FaultCNN):
            self.quant, self.dequant = nn.Identity(), nn.Identity()
            self.layers = nn.Sequential(*list(module.features)[1:])
        elif isinstance(module, QuantReadyCNN) or hasattr(module, "quant"):
            self.quant, self.dequant, self.layers = module.quant, module.dequant, module.layers
        else:
            raise TypeError(f"cannot export a {type(module).__name__}: a FaultCNN or its int8 model")
        self.head = module.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.head(self.layers(self.quant(self.front(x)))))


def to_torchscript(module: nn.Module, window: tuple[int, int]) -> torch.jit.ScriptModule:
    """``module`` (a FaultCNN or its int8 model) with the fast front end, traced on one
    window of shape ``window`` = (C, L) and frozen: the line's computer loads it with
    ``torch.jit.load`` alone. The window length is fixed by the trace."""
    edge = EdgeCNN(module.eval(), int(window[-1])).eval()
    with torch.no_grad():
        return torch.jit.freeze(torch.jit.trace(edge, torch.zeros(1, *window), check_trace=False))


def torchscript_bytes(module: torch.jit.ScriptModule) -> bytes:
    buffer = io.BytesIO()
    torch.jit.save(module, buffer)
    return buffer.getvalue()


def weight_bytes(module: nn.Module) -> int:
    """Bytes of the weights alone: int8 values at one byte (plus their scales and zero
    points), float tensors at their element size; without TorchScript's code and constants."""
    total = 0
    for value in module.state_dict().values():
        tensors = value if isinstance(value, tuple) else (value,)
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                continue
            if tensor.is_quantized:
                total += tensor.numel() + tensor.q_per_channel_scales().numel() * 12 \
                    if tensor.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric) else tensor.numel() + 12
            else:
                total += tensor.numel() * tensor.element_size()
    return total


@torch.no_grad()
def predict_classes(module, x: np.ndarray, batch_size: int = 512) -> np.ndarray:
    return np.concatenate(
        [module(torch.from_numpy(x[i : i + batch_size])).argmax(dim=1).numpy() for i in range(0, len(x), batch_size)]
    )


@dataclass(frozen=True)
class Latency:
    single_us: float  # one window per call (a request at the line)
    batched_us: float  # per window, in batches of ``batch``


@torch.no_grad()
def latency(module, x: np.ndarray, batch: int = 256, min_seconds: float = 1.0) -> Latency:
    """Median wall time per window on the current torch threads (set them first): one window
    per call, and per window in a batch; after a warm-up, over at least ``min_seconds``."""

    def per_window(inputs: torch.Tensor) -> float:
        for _ in range(5):
            module(inputs)
        times = []
        deadline = time.perf_counter() + min_seconds
        while time.perf_counter() < deadline or len(times) < 5:
            start = time.perf_counter()
            module(inputs)
            times.append(time.perf_counter() - start)
        return float(np.median(times)) / len(inputs) * 1e6

    return Latency(per_window(torch.from_numpy(x[:1])), per_window(torch.from_numpy(x[:batch])))


# --------------------------------------------------------------------------- command line


def add_commands(commands) -> None:
    """Add ``export`` to the ``fedind`` subcommands (argparse subparsers)."""
    export = commands.add_parser(
        "export", help="write an int8 model for the line's computer (TorchScript)",
        description="Quantise MODEL to int8 (post-training static quantisation calibrated on the site's own "
        "windows) and write it as TorchScript (torch.jit.load runs it, no fedind needed), with a faster front end "
        "that computes the same values. With --student-width, first distil a narrower model from MODEL on those "
        "windows (their labels too), then quantise it (or not: --float). "
        "Prints its size and agreement with the float model on the windows.",
    )
    export.add_argument("--model", required=True, type=Path, metavar="PATH", help="model file, run or checkpoint folder")
    export.add_argument("--calibration", required=True, type=Path, metavar="NPZ",
                        help="the site's windows (a train.npz of the site data format, or .npy)")
    export.add_argument("--out", required=True, type=Path, metavar="FILE", help="TorchScript file to write (.pt)")
    export.add_argument("--student-width", type=int, default=None, metavar="W", help="distil a width-W student first")
    export.add_argument("--epochs", type=int, default=30, metavar="E", help="distillation epochs (default %(default)s)")
    export.add_argument("--float", action="store_true", dest="keep_float",
                        help="no int8 quantisation: the model (or the student) in float, with the fast front end")
    export.set_defaults(run=_export)


def _export(args) -> int:
    from ..files import atomic_write
    from .predict import check_fits, load_model, read_windows

    loaded = load_model(args.model)
    windows = read_windows(args.calibration)
    check_fits(loaded, windows)
    source = loaded.model
    if args.student_width is not None:
        source = distil(loaded.model, windows.x, windows.y, width=args.student_width, epochs=args.epochs)
    exported = source if args.keep_float else quantize_static(source, windows.x)
    data = torchscript_bytes(to_torchscript(exported, windows.x.shape[1:]))
    atomic_write(args.out, data)
    float_bytes = loaded.path.stat().st_size
    agree = float(np.mean(predict_classes(exported, windows.x) == predict_classes(loaded.model, windows.x)))
    kind = "float" if args.keep_float else "int8"
    print(f"wrote {args.out}: {kind} {'student width ' + str(args.student_width) if args.student_width else 'model'} "
          f"of {loaded.path} (sha256 {loaded.sha256[:16]}…), {len(data)} bytes "
          f"({float_bytes / len(data):.1f}x smaller than the float file), "
          f"agrees with the float model on {agree:.1%} of {len(windows.x)} windows")
    return 0
