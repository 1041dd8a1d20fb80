"""The results folder of one run: rounds.csv, summary.json, model.safetensors(+sha256), plot."""

from __future__ import annotations

import csv
import json
import math
import platform
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..files import atomic_write, write_verified

ROUND_FIELDS = (
    "round", "accuracy", "loss", "uplink_bytes", "downlink_bytes", "sites", "failures", "seconds",
)


@dataclass(frozen=True)
class RoundRow:
    round: int
    accuracy: float  # global model on the held-out global test set
    loss: float
    uplink_bytes: int  # serialized site -> server payloads this round
    downlink_bytes: int  # serialized server -> site payloads this round
    sites: int  # sites whose reply was aggregated
    failures: int  # sites that failed, timed out or were rejected
    seconds: float  # wall time of the round


def rounds_to_target(accuracies: list[float], target: float) -> int | None:
    """First round (1-based) whose accuracy reaches ``target``; None if never."""
    for index, accuracy in enumerate(accuracies, start=1):
        if accuracy >= target:
            return index
    return None


def best_round(accuracies: list[float]) -> int | None:
    """Index of the best scored round (NaN rounds are unscored: no global test set);
    None when no round was scored."""
    scored = [(a, -i) for i, a in enumerate(accuracies) if math.isfinite(a)]
    return -max(scored)[1] if scored else None


def finite_or_none(value: float | None) -> float | None:
    """``value``, or None for NaN/inf (summary.json is strict JSON: null, never NaN)."""
    return value if value is not None and math.isfinite(value) else None


def package_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    versions = {"python": platform.python_version()}
    for name in ("fedind", "flwr", "torch", "numpy", "phe", "safetensors"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def save_model(path: Path, state: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> str:
    """Write safetensors atomically plus ``<name>.sha256``; return the SHA-256 hex digest."""
    from safetensors.numpy import save

    return write_verified(path, save({k: np.ascontiguousarray(v) for k, v in state.items()}, metadata=dict(metadata)))


def _csv_values(row: RoundRow) -> list:
    values = asdict(row)
    return [f"{values[k]:.6f}" if isinstance(values[k], float) else values[k] for k in ROUND_FIELDS]


class RunRecorder:
    """Appends one row per round (flushed, so a crash keeps every finished round)."""

    def __init__(self, folder: Path, rows: list[RoundRow] = (), initial_accuracy: float | None = None) -> None:
        """Start rounds.csv afresh, with ``rows`` (a resumed run's rounds up to its checkpoint)."""
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.rows: list[RoundRow] = list(rows)
        self.initial_accuracy = initial_accuracy  # of the untrained model, for the plot
        with open(folder / "rounds.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(ROUND_FIELDS)
            writer.writerows(_csv_values(row) for row in self.rows)

    def add(self, row: RoundRow) -> None:
        self.rows.append(row)
        with open(self.folder / "rounds.csv", "a", newline="") as f:
            csv.writer(f).writerow(_csv_values(row))

    def write_summary(self, summary: Mapping) -> Path:
        path = self.folder / "summary.json"
        atomic_write(path, (json.dumps(summary, indent=2, sort_keys=False) + "\n").encode())
        return path

    def plot(self, title: str) -> Path:
        """Accuracy and cumulative traffic per round, as one PNG."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rounds = [r.round for r in self.rows]
        fig, (ax_acc, ax_bytes) = plt.subplots(1, 2, figsize=(10, 3.8))
        start = [] if self.initial_accuracy is None else [(0, self.initial_accuracy)]
        points = start + [(r.round, r.accuracy) for r in self.rows]
        ax_acc.plot([p[0] for p in points], [p[1] for p in points], marker=".")
        ax_acc.set(xlabel="round", ylabel="global test accuracy", ylim=(0, 1), title=title)
        ax_acc.grid(alpha=0.3)
        up = np.cumsum([r.uplink_bytes for r in self.rows]) / 1e6
        down = np.cumsum([r.downlink_bytes for r in self.rows]) / 1e6
        ax_bytes.plot(rounds, up, label="uplink (sites -> server)")
        ax_bytes.plot(rounds, down, label="downlink (server -> sites)")
        ax_bytes.set(xlabel="round", ylabel="cumulative MB", title="traffic")
        ax_bytes.legend()
        ax_bytes.grid(alpha=0.3)
        fig.tight_layout()
        path = self.folder / "progress.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path
