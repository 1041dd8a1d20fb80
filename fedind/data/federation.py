"""A synthetic federation of production lines: Non-IID in labels, quantity and features.

- label and quantity skew: a balanced pool of labels is split across sites with
  flwr-datasets' ``DirichletPartitioner`` (per class, proportions ~ Dir(alpha)), so
  small alpha gives each line a few dominant fault classes and very different sizes;
- feature skew: every site synthesises its windows under its own ``Regime`` (speed,
  sample rate, resonance, sensor gain/offset, noise).

Each site's labels are split into its train and local test set. The global test set has
every class under every site's regime, balanced: the model the federation ships should
diagnose every fault on every line. Everything is a pure function of the spec (seed).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .format import SiteArrays, write_meta, write_split
from .synthetic import CLASS_NAMES, NUM_CLASSES, Regime, sample_regime, synthesize


@dataclass(frozen=True)
class FederationSpec:
    """Everything that determines a synthetic federation."""

    num_sites: int = 10
    alpha: float = 0.3
    samples_per_site: int = 240  # mean number of windows per site (train + local test)
    test_fraction: float = 0.2  # share of each site's windows kept as its local test set
    global_test_per_class: int = 6  # per site regime and class, in the global test set
    window: int = 1024
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_sites < 1:
            raise ValueError(f"Invalid num_sites: {self.num_sites} (need >= 1)")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"Invalid dirichlet alpha: {self.alpha} (need > 0)")
        if self.samples_per_site < 20:
            raise ValueError(f"Invalid samples_per_site: {self.samples_per_site} (need >= 20)")
        if not 0 < self.test_fraction < 1:
            raise ValueError(f"Invalid test_fraction: {self.test_fraction} (need 0 < f < 1)")
        if self.window < 64:
            raise ValueError(f"Invalid window: {self.window} (need >= 64 samples)")


def site_ids(num_sites: int) -> list[str]:
    return [f"line-{i:02d}" for i in range(num_sites)]


def _rng(spec: FederationSpec, *stream: int) -> np.random.Generator:
    """An independent generator per (seed, purpose, site): sites never share streams."""
    return np.random.default_rng([spec.seed, *stream])


def site_regimes(spec: FederationSpec) -> list[Regime]:
    return [sample_regime(_rng(spec, 1, i)) for i in range(spec.num_sites)]


@functools.lru_cache(maxsize=8)
def site_label_sets(spec: FederationSpec, num_classes: int = NUM_CLASSES) -> tuple[np.ndarray, ...]:
    """Labels of every site (train + local test), split by Dirichlet(alpha) per class
    (``num_classes``: of the data family, the bearing family's by default)."""
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner

    per_class = spec.num_sites * spec.samples_per_site // num_classes
    pool = Dataset.from_dict({"label": np.repeat(np.arange(num_classes), per_class)})
    min_size = max(1, min(20, per_class * num_classes // (2 * spec.num_sites)))
    partitioner = DirichletPartitioner(
        num_partitions=spec.num_sites,
        partition_by="label",
        alpha=spec.alpha,
        min_partition_size=min_size,
        self_balancing=False,
        seed=spec.seed,
    )
    partitioner.dataset = pool
    try:
        partitioner.load_partition(0)  # draws the whole split
    except ValueError as err:  # flwr-datasets: "... update the values of alpha": say what it means here
        raise ValueError(
            f"too few windows per site: {per_class * num_classes} windows ({spec.samples_per_site} per site) "
            f"could not be split among {spec.num_sites} sites with alpha {spec.alpha:g} so that each gets at "
            f"least {min_size}; raise samples-per-site or alpha, or use fewer sites ({err})"
        ) from err
    return tuple(
        np.asarray(partitioner.load_partition(i)["label"], dtype=np.int64)
        for i in range(spec.num_sites)
    )


@functools.lru_cache(maxsize=64)  # one simulation worker serves many sites in turn
def make_site(spec: FederationSpec, index: int) -> tuple[SiteArrays, SiteArrays]:
    """Train and local test windows of site ``index`` (cached: a site agent loads once)."""
    if not 0 <= index < spec.num_sites:
        raise ValueError(f"site index {index} outside the federation of {spec.num_sites} sites")
    rng = _rng(spec, 2, index)
    labels = rng.permutation(site_label_sets(spec)[index])
    num_test = max(1, int(round(spec.test_fraction * labels.size)))
    x = synthesize(labels, site_regimes(spec)[index], spec.window, rng)
    return (
        SiteArrays(x[num_test:], labels[num_test:]),
        SiteArrays(x[:num_test], labels[:num_test]),
    )


@functools.lru_cache(maxsize=2)
def make_global_test(spec: FederationSpec) -> SiteArrays:
    """Every class under every site's regime, ``global_test_per_class`` windows each."""
    xs, ys = [], []
    for index, regime in enumerate(site_regimes(spec)):
        labels = np.repeat(np.arange(NUM_CLASSES), spec.global_test_per_class)
        xs.append(synthesize(labels, regime, spec.window, _rng(spec, 3, index)))
        ys.append(labels)
    return SiteArrays(np.concatenate(xs), np.concatenate(ys))


def write_federation(spec: FederationSpec, out: str | Path) -> Path:
    """Write the federation in the site data format (docs/data-format.md) under ``out``."""
    out = Path(out)
    for index, site in enumerate(site_ids(spec.num_sites)):
        train, test = make_site(spec, index)
        write_split(out / "sites" / site / "train.npz", train)
        write_split(out / "sites" / site / "test.npz", test)
    write_split(out / "test.npz", make_global_test(spec))
    write_meta(
        out,
        {
            "num_classes": NUM_CLASSES,
            "class_names": list(CLASS_NAMES),
            "generator": {"name": "fedind.data.synthetic", **asdict(spec)},
            "regimes": {s: r.to_dict() for s, r in zip(site_ids(spec.num_sites), site_regimes(spec))},
        },
    )
    return out
