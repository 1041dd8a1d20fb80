"""Calibrate a finished plant run's final head after the fact, on virtual features (CCVR),
and score it before and after: the probe that chose head-calibration's covariance
(docs/benchmarks/plant.md, "Head calibration on virtual features").

    python simulations/calibration_probe.py runs/sel-base-a0.1 --alpha 0.1 --seed 4 --covariance shrunk

Moments come from every line's phase-1 training windows plus 256 of its phase-0 windows (a
stand-in for its replay buffer), under the run's final model; the run's folder is the one
``simulations/plant.py --variants recipe`` wrote for that alpha and seed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from simulations.common import parse_overrides, pyproject_run_config  # noqa: E402
from simulations.plant import SCENARIO, variant_config  # noqa: E402
from fedind.continual.calibration import calibrate_head, class_moments, merge_moments, shrunk_covariances  # noqa: E402
from fedind.continual.phases import evaluate_known  # noqa: E402
from fedind.data.drift import phase_global_test, phase_site  # noqa: E402
from fedind.edge.predict import load_model  # noqa: E402
from fedind.training import window_features  # noqa: E402

COVARIANCES = ("own", "diagonal", "pooled", "shrunk")


def covariances(counts: np.ndarray, scatter: np.ndarray, kind: str) -> np.ndarray:
    """Each class's covariance for the virtual features, by ``kind`` (one of COVARIANCES)."""
    own = scatter / np.maximum(counts, 1)[:, None, None]
    pooled = scatter.sum(axis=0) / counts.sum()
    if kind == "own":
        return own
    if kind == "diagonal":
        return np.stack([np.diag(np.diag(c)) for c in own])
    if kind == "pooled":
        return np.broadcast_to(pooled, own.shape).copy()
    return shrunk_covariances(counts, scatter)  # what head-calibration uses


def score(model, drift, num_classes: int) -> tuple[float, float]:
    """(accuracy over both phases' global tests, recall of the new class) of ``model``, as
    the server scores a phase (:func:`~fedind.continual.phases.evaluate_known`)."""
    scores = [evaluate_known(model, phase_global_test(drift, phase), torch.device("cpu"), new_from=num_classes - 1)
              for phase in (0, 1)]
    accuracy = sum(s.correct for s in scores) / sum(s.num_examples for s in scores)
    return accuracy, scores[1].new_correct / scores[1].num_new


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the plant benchmark's --out folder")
    parser.add_argument("--alpha", type=float, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--covariance", choices=COVARIANCES, default="shrunk")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    config = variant_config(parse_overrides([], {**pyproject_run_config(), **SCENARIO}), "recipe", args.alpha,
                            args.seed, args.out)
    model = load_model(args.out / "runs" / config.run_name).model.eval()
    num_classes, drift = model.head.out_features, config.drift_spec()
    rng = np.random.default_rng(0)
    parts = []
    for line in range(config.num_sites):
        new, _ = phase_site(drift, line, 1)
        old, _ = phase_site(drift, line, 0)
        kept = rng.choice(old.y.size, min(256, old.y.size), replace=False)
        x, y = np.concatenate([new.x, old.x[kept]]), np.concatenate([new.y, old.y[kept]])
        parts.append(class_moments(window_features(model, x, torch.device("cpu")), y))
    counts, means, scatter = merge_moments(parts, num_classes)
    before = score(model, drift, num_classes)
    weight, bias = model.head.weight.detach().numpy(), model.head.bias.detach().numpy()
    weight, bias = calibrate_head(weight, bias, counts, means, covariances(counts, scatter, args.covariance))
    with torch.no_grad():
        model.head.weight.copy_(torch.as_tensor(weight))
        model.head.bias.copy_(torch.as_tensor(bias))
    after = score(model, drift, num_classes)
    print(f"{config.run_name}: accuracy {100 * before[0]:.1f} -> {100 * after[0]:.1f} %, new-class recall "
          f"{100 * before[1]:.0f} -> {100 * after[1]:.0f} % ({args.covariance} covariances)")


if __name__ == "__main__":
    main()
