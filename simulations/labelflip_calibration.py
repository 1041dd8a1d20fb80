"""Where a mislabelling line's harm lands: a poisoning run's class recall before and after the
head calibration of its last round, and that calibration redone with other merges of the
lines' feature moments (docs/benchmarks/poisoning.md, "Where the targeted attack lands").

    python simulations/labelflip_calibration.py runs/q35-ev/runs/fedind-labelflip1-seed6
    python simulations/labelflip_calibration.py runs/q35-base/runs/fedind-clean-seed0 --relabel 1

The folder is one run of ``simulations/poisoning.py`` (pyproject's configuration, its seed
read from the name). The run's last two checkpoints give the model before calibration (round
39's head) and the calibrated one (round 40); the calibration is then redone on round 40's
body, with each line's moments recomputed from its phase-1 training windows (without its
replay buffer: the calibration itself adds those), line 0's class ``--relabel`` labelled
healthy (``labelflip`` runs: the attacked class, automatically), under three merges:

- ``merged``: fedind's (one Gaussian per class, :func:`fedind.continual.calibration.merge_moments`);
- ``trimmed``: per class held by five lines or more, the line whose class mean lies farthest
  from the other lines' pooled mean (in within-class radii) is left out;
- ``mixture``: each class's virtual features drawn from its lines' own Gaussians, split by
  their windows;
- ``consistent``: a line's part of a class is left out when its mean lies nearer another
  class's pooled mean of the other lines than its own class's (Mahalanobis distance under
  the other lines' pooled within-class covariance): features that the rest of the
  federation reads as another class;
- ``floor``: fedind's merge of the moments of the windows whose label the model before
  calibration (round 39's here; the run's own round-40 model in fedind) gives a
  probability of at least ``--floor`` (:func:`fedind.continual.calibration.agreeing`, the
  recipe's ``calibration-label-floor`` since the fourteenth session).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from simulations.common import parse_overrides  # noqa: E402
from fedind.continual import calibration as cal  # noqa: E402
from fedind.data.format import SiteArrays  # noqa: E402
from fedind.data.sources import phase_test_set, site_from_partition  # noqa: E402
from fedind.models import FaultCNN  # noqa: E402
from fedind.server.checkpoint import CheckpointStore  # noqa: E402
from fedind.training import evaluate, window_features  # noqa: E402

MERGES = ("merged", "trimmed", "mixture", "consistent", "floor")
MIN_HOLDERS = 5  # trimmed: classes held by fewer lines are merged as they are


def gaps(parts: list[cal.ClassMoments], c: int) -> dict[int, float]:
    """Per line holding class ``c``: its class mean's distance to the other lines' pooled
    mean, over the root mean trace of the lines' class covariances (the within-class radius)."""
    holders = {i: int(np.flatnonzero(p.classes == c)[0]) for i, p in enumerate(parts) if c in p.classes}
    radius = np.sqrt(np.mean([np.trace(parts[i].covariances[j]) for i, j in holders.items()]))
    out = {}
    for i, j in holders.items():
        others = [(parts[k].counts[m], parts[k].means[m]) for k, m in holders.items() if k != i]
        pooled = sum(n * mu for n, mu in others) / sum(n for n, _ in others)
        out[i] = float(np.linalg.norm(parts[i].means[j] - pooled) / radius)
    return out


def trimmed(parts: list[cal.ClassMoments], num_classes: int) -> list[cal.ClassMoments]:
    """``parts`` without, per class of :data:`MIN_HOLDERS` holders or more, the farthest line's part."""
    left_out = {i: set() for i in range(len(parts))}
    for c in range(num_classes):
        distance = gaps(parts, c) if sum(c in p.classes for p in parts) >= MIN_HOLDERS else {}
        if distance:
            left_out[max(distance, key=distance.get)].add(c)
    kept = []
    for i, p in enumerate(parts):
        keep = np.array([c not in left_out[i] for c in p.classes], dtype=bool)
        if keep.any():
            kept.append(cal.ClassMoments(p.classes[keep], p.counts[keep], p.means[keep], p.covariances[keep]))
    return kept


def consistent(parts: list[cal.ClassMoments], num_classes: int) -> list[cal.ClassMoments]:
    """``parts`` without the class parts that the other lines' Gaussians read as another class."""
    kept = []
    for i, p in enumerate(parts):
        counts, means, scatter = cal.merge_moments([q for k, q in enumerate(parts) if k != i], num_classes)
        pooled = scatter.sum(axis=0) / counts.sum()
        inverse = np.linalg.inv(pooled + 1e-3 * np.trace(pooled) / len(pooled) * np.eye(len(pooled)))
        present = np.flatnonzero(counts > 0)
        keep = np.ones(len(p.classes), dtype=bool)
        for j, c in enumerate(p.classes):
            if c in present:
                gap = means[present] - p.means[j]
                keep[j] = present[np.argmin(np.einsum("ij,jk,ik->i", gap, inverse, gap))] == c
        if keep.any():
            kept.append(cal.ClassMoments(p.classes[keep], p.counts[keep], p.means[keep], p.covariances[keep]))
    return kept


def virtual_features(parts, num_classes: int, merge: str, rng) -> tuple[np.ndarray, np.ndarray]:
    """:data:`cal.SAMPLES_PER_CLASS` virtual features per class, drawn as ``merge`` says (with
    :func:`fedind.continual.calibration.draw_gaussian`, as the server's calibration draws)."""
    chosen = {"trimmed": trimmed, "consistent": consistent}.get(merge)
    counts, means, scatter = cal.merge_moments(chosen(parts, num_classes) if chosen else parts, num_classes)
    present = np.flatnonzero(counts)
    covariances, f = cal.shrunk_covariances(counts, scatter), means.shape[1]
    pooled = scatter.sum(axis=0) / counts.sum()
    ridge = cal.sampling_ridge(covariances[present])
    zs, ys = [], []
    for c in present:
        if merge != "mixture":
            components = [(cal.SAMPLES_PER_CLASS, means[c], covariances[c])]
        else:  # each line's Gaussian, its covariance shrunk to the pooled one as merge_moments' are
            own = [(p.counts[j], p.means[j], p.covariances[j]) for p in parts for j in np.flatnonzero(p.classes == c)]
            total = sum(n for n, _, _ in own)
            components = [(max(1, round(cal.SAMPLES_PER_CLASS * n / total)), mu, (n * cov + f * pooled) / (n + f))
                          for n, mu, cov in own]
        for n, mean, covariance in components:
            zs.append(cal.draw_gaussian(rng, mean, covariance, n, ridge))
            ys.append(np.full(n, c))
    return np.concatenate(zs), np.concatenate(ys)


def recall_summary(arrays: dict, test: SiteArrays, target: int) -> str:
    model = FaultCNN.from_state_dict({k: torch.from_numpy(np.array(v)) for k, v in arrays.items()})
    confusion = evaluate(model, test, torch.device("cpu")).confusion
    recall = np.diag(confusion) / np.maximum(confusion.sum(axis=1), 1)
    return (f"accuracy {100 * np.trace(confusion) / confusion.sum():.1f} %, class {target} recall {recall[target]:.2f}, "
            f"called healthy {confusion[target, 0] / confusion[target].sum():.2f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="one run folder of simulations/poisoning.py")
    parser.add_argument("--relabel", type=int, default=None, help="line 0's class called healthy (default: a "
                        "labelflip run's class, else none)")
    parser.add_argument("--floor", type=float, default=0.01, help="the floor merge's probability floor")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    match = re.fullmatch(r".*?-(?:labelflip(\d+)|[a-z0-9.]+)-seed(\d+)", args.run.name)
    if match is None:
        raise SystemExit(f"{args.run}: not a poisoning run folder (<strategy>-<attack>-seed<N>)")
    relabel = args.relabel if args.relabel is not None else (int(match.group(1)) if match.group(1) else None)
    config = parse_overrides([f"seed={match.group(2)}"])
    store = CheckpointStore(args.run / "checkpoints")
    before, after = store.load(config.num_server_rounds - 1).arrays, store.load(config.num_server_rounds).arrays
    num_classes = after["head.bias"].shape[0]
    sets = [phase_test_set(config.drift_spec(), config.data_root, q) for q in range(config.phases)]
    x, y = np.concatenate([t.x for t in sets]), np.concatenate([t.y for t in sets])
    test, target = SiteArrays(x[y < num_classes], y[y < num_classes]), relabel if relabel is not None else 1
    print(f"{args.run.name}: before calibration {recall_summary(before, test, target)}")
    print(f"{args.run.name}: after calibration  {recall_summary(after, test, target)}")
    body = FaultCNN.from_state_dict({k: torch.from_numpy(np.array(v)) for k, v in after.items()}).eval()
    parts, floored = [], []
    for line in range(config.num_sites):
        site = site_from_partition(config.drift_spec(), config.data_root, line, config.num_sites, 1)
        known = site.train.y < num_classes
        labels = site.train.y[known]
        if line == 0 and relabel is not None:
            labels = np.where(labels == relabel, 0, labels)
        features = window_features(body, site.train.x[known], torch.device("cpu"))
        parts.append(cal.class_moments(features, labels))
        kept = cal.agreeing(features, labels, before["head.weight"], before["head.bias"], args.floor)
        floored.append(cal.class_moments(features[kept], labels[kept]))
    seed = config.seed * 1_000_003 + config.num_server_rounds  # the server's calibration seed
    for merge in MERGES:
        chosen = (floored, "merged") if merge == "floor" else (parts, merge)
        z, labels = virtual_features(*chosen[:1], num_classes, chosen[1], np.random.default_rng(seed))
        weight, bias = cal.fit_head(before["head.weight"], before["head.bias"], z, labels, seed=seed)
        print(f"{args.run.name}: redone, {merge:8s}  {recall_summary({**after, 'head.weight': weight, 'head.bias': bias}, test, target)}")


if __name__ == "__main__":
    main()
