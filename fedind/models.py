"""Compact 1D-CNNs for vibration windows ``[batch, channels, length]``."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn


def standardize(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Zero mean, unit variance per window and channel."""
    mean = x.mean(dim=-1, keepdim=True)
    std = x.std(dim=-1, keepdim=True, unbiased=False)
    return (x - mean) / (std + eps)


def hilbert_envelope(x: torch.Tensor) -> torch.Tensor:
    """Magnitude of the analytic signal along the last axis (FFT Hilbert transform)."""
    n = x.shape[-1]
    spectrum = torch.fft.fft(x.float(), dim=-1)
    h = torch.zeros(n, device=x.device)
    h[0] = 1.0
    h[1 : (n + 1) // 2] = 2.0
    if n % 2 == 0:
        h[n // 2] = 1.0
    return torch.fft.ifft(spectrum * h, dim=-1).abs()


class VibrationFrontEnd(nn.Module):
    """Fixed signal conditioning of classical bearing diagnostics, per input channel:

    1. the window, standardised: sensor gain and DC offset differ per production line,
       removing them makes the network exactly invariant to both;
    2. its first difference, standardised: pre-whitening that suppresses the shaft
       harmonics and leaves the broadband fault impacts;
    3. the Hilbert envelope of (2), standardised: envelope analysis, whose rhythm is the
       fault's characteristic frequency whatever resonance the impacts excite.

    No parameters: ``[B, C, L] -> [B, 3C, L]``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        diff = torch.diff(x, dim=-1, prepend=x[..., :1])
        return torch.cat([standardize(x), standardize(diff), standardize(hilbert_envelope(diff))], dim=1)


def _block(c_in: int, c_out: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    # GroupNorm, not BatchNorm: batch statistics differ per site under Non-IID data and
    # running averages do not survive federated averaging.
    return [
        nn.Conv1d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False),
        nn.GroupNorm(4, c_out),
        nn.ReLU(inplace=True),
    ]


class FaultCNN(nn.Module):
    """WDCNN-style classifier: a wide first kernel sees whole impacts, small kernels follow.

    (Zhang et al. 2017, "A new deep learning model for fault diagnosis with good
    anti-noise and domain adaptation ability on raw vibration signals".)
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        if in_channels < 1 or num_classes < 2 or width < 4 or width % 4:
            raise ValueError(
                f"Invalid FaultCNN shape: in_channels={in_channels}, "
                f"num_classes={num_classes}, width={width} (width must be a multiple of 4)"
            )
        self.features = nn.Sequential(
            VibrationFrontEnd(),
            *_block(3 * in_channels, width, kernel=64, stride=8),
            nn.MaxPool1d(2),
            *_block(width, 2 * width, kernel=3),
            nn.MaxPool1d(2),
            *_block(2 * width, 2 * width, kernel=3),
            nn.MaxPool1d(2),
            *_block(2 * width, 4 * width, kernel=3),
            nn.AdaptiveAvgPool1d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def condition(self, x: torch.Tensor) -> torch.Tensor:
        """The fixed front end alone: ``[B, C, L] -> [B, 3C, L]``, no parameters."""
        return self.features[0](x)

    def classify(self, z: torch.Tensor) -> torch.Tensor:
        """The trainable layers on conditioned windows: ``forward(x) == classify(condition(x))``.
        Training computes ``condition`` once per dataset, not once per batch and epoch."""
        for layer in list(self.features)[1:]:
            z = layer(z)
        return self.head(z)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, torch.Tensor]) -> "FaultCNN":
        """Build the model whose shapes match ``state`` and load it (strict)."""
        first = state["features.1.weight"]  # [width, 3 * in_channels, kernel]
        model = cls(
            in_channels=int(first.shape[1]) // 3,
            num_classes=int(state["head.weight"].shape[0]),
            width=int(first.shape[0]),
        )
        model.load_state_dict(state, strict=True)
        return model


def initial_state(seed: int, in_channels: int, num_classes: int, width: int) -> dict[str, np.ndarray]:
    """The run's initial model as the server builds it (FaultCNN right after
    ``torch.manual_seed(seed)``), without touching the caller's random state: a site can
    make it itself instead of receiving it (fedind.topk.downlink checks the digest)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = FaultCNN(in_channels=in_channels, num_classes=num_classes, width=width)
    return {name: t.detach().cpu().numpy() for name, t in model.state_dict().items()}
