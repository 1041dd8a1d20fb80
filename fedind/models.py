"""Compact 1D-CNNs for vibration windows ``[batch, channels, length]``."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


class WindowStandardize(nn.Module):
    """Zero mean, unit variance per window and channel.

    Sensor gain and DC offset differ per production line; removing them here makes the
    network exactly invariant to both, so sites with different sensors share features.
    """

    def __init__(self, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=-1, keepdim=True)
        std = x.std(dim=-1, keepdim=True, unbiased=False)
        return (x - mean) / (std + self.eps)


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
            WindowStandardize(),
            *_block(in_channels, width, kernel=64, stride=8),
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

    @classmethod
    def from_state_dict(cls, state: Mapping[str, torch.Tensor]) -> "FaultCNN":
        """Build the model whose shapes match ``state`` and load it (strict)."""
        first = state["features.1.weight"]  # [width, in_channels, kernel]
        model = cls(
            in_channels=int(first.shape[1]),
            num_classes=int(state["head.weight"].shape[0]),
            width=int(first.shape[0]),
        )
        model.load_state_dict(state, strict=True)
        return model
