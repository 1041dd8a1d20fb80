"""A synthetic federation whose data arrive in phases: drifting regimes and a new fault class.

Phase 0 is the federation of :mod:`fedind.data.federation` (the same Dirichlet label split,
the same line regimes) without the ``new_classes`` last fault classes: no line has seen
them yet, and the initial global model has ``NUM_CLASSES - new_classes`` classes. Every
phase ``p >= 1`` is a fresh batch of windows at every line (the old batch is gone from the
line, as on a plant host):

- **regime drift**: a share ``regime_share`` of the lines, drawn anew at each phase, start
  running under a new operating regime (a new draw of :func:`~fedind.data.synthetic.sample_regime`:
  shaft speed, sensor sample rate, resonance, gain, offset, noise) whose shaft speed is
  ``speed_factor`` times the drawn one (a new product at a new line speed: at 1.5 the fault
  impact periods of one class, in samples, overlap those of another class at the old
  speeds); the others keep theirs;
- **fault mix**: each line's labels are a new Dirichlet(alpha) split of the pool (faults
  come and go at a line), with the held-out classes removed everywhere but at
- **a new fault class**: from phase 1 on, one line (drawn with the seed) also sees the
  ``new_classes`` held-out classes, each with the share of an average class at that line.

The global test set of phase ``p`` has every class known in phase ``p`` under every line's
phase-``p`` regime, ``global_test_per_class`` windows each. Everything is a pure function
of the spec (seed). :func:`write_drift_federation` writes it in the on-disk phase layout
(:mod:`fedind.data.format`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from .federation import FederationSpec, site_ids, site_label_sets, site_regimes
from .format import SiteArrays, phase_name, write_meta, write_split
from .synthetic import CLASS_NAMES, NUM_CLASSES, Regime, sample_regime, synthesize


@dataclass(frozen=True)
class DriftSpec:
    """Everything that determines a synthetic multi-phase federation."""

    federation: FederationSpec = FederationSpec()
    phases: int = 1
    regime_share: float = 0.5
    new_classes: int = 1
    speed_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.phases < 1:
            raise ValueError(f"Invalid phases: {self.phases} (need >= 1)")
        if not 0 <= self.regime_share <= 1:
            raise ValueError(f"Invalid regime_share: {self.regime_share} (need 0 <= share <= 1)")
        if not 0 <= self.new_classes <= NUM_CLASSES - 2:
            raise ValueError(f"Invalid new_classes: {self.new_classes} (need 0..{NUM_CLASSES - 2})")
        if not 0.25 <= self.speed_factor <= 4:
            raise ValueError(f"Invalid speed_factor: {self.speed_factor} (need 0.25..4)")

    @property
    def held_out(self) -> int:
        """Classes missing from phase 0 (none with a single phase)."""
        return self.new_classes if self.phases > 1 else 0


def _rng(drift: DriftSpec, *stream: int) -> np.random.Generator:
    # Streams 10+ (federation.py uses 1-3): phase data never share a stream with the static federation.
    return np.random.default_rng([drift.federation.seed, *stream])


def phase_classes(drift: DriftSpec, phase: int) -> int:
    """Number of classes any line can have seen by ``phase``."""
    _check_phase(drift, phase)
    return NUM_CLASSES - drift.held_out if phase == 0 else NUM_CLASSES


def new_class_site(drift: DriftSpec) -> int | None:
    """Index of the line that first sees the held-out classes (phase 1); None without any."""
    if not drift.held_out:
        return None
    return int(_rng(drift, 10).integers(drift.federation.num_sites))


def drifted_sites(drift: DriftSpec, phase: int) -> tuple[int, ...]:
    """Lines whose regime changes at the start of ``phase`` (none at phase 0)."""
    _check_phase(drift, phase)
    if phase == 0:
        return ()
    n = drift.federation.num_sites
    count = int(round(drift.regime_share * n))
    return tuple(sorted(int(i) for i in _rng(drift, 11, phase).permutation(n)[:count]))


@functools.lru_cache(maxsize=8)
def phase_regimes(drift: DriftSpec, phase: int) -> tuple[Regime, ...]:
    """Every line's regime during ``phase``."""
    _check_phase(drift, phase)
    if phase == 0:
        return tuple(site_regimes(drift.federation))
    regimes = list(phase_regimes(drift, phase - 1))
    for i in drifted_sites(drift, phase):
        regime = sample_regime(_rng(drift, 12, phase, i))
        regimes[i] = replace(regime, shaft_hz=regime.shaft_hz * drift.speed_factor)
    return tuple(regimes)


@functools.lru_cache(maxsize=8)
def phase_label_sets(drift: DriftSpec, phase: int, num_classes: int = NUM_CLASSES) -> tuple[np.ndarray, ...]:
    """Labels (train + local test) of every line in ``phase`` (``num_classes``: of the data
    family, the bearing family's by default)."""
    _check_phase(drift, phase)
    spec = drift.federation
    if phase > 0:  # a new Dirichlet split of the same pool
        seed = int(np.random.SeedSequence([spec.seed, 13, phase]).generate_state(1)[0])
        spec = replace(spec, seed=seed)
    known = num_classes - drift.held_out
    labels = [np.asarray(y[y < known], dtype=np.int64) for y in site_label_sets(spec, num_classes)]
    source = new_class_site(drift)
    if phase > 0 and source is not None:
        per_class = max(8, int(round(labels[source].size / known)))
        extra = np.repeat(np.arange(known, num_classes), per_class)
        labels[source] = np.concatenate([labels[source], extra])
    return tuple(labels)


@functools.lru_cache(maxsize=32)
def phase_site(drift: DriftSpec, index: int, phase: int) -> tuple[SiteArrays, SiteArrays]:
    """Train and local test windows of line ``index`` in ``phase`` (cached: a site agent
    trains on them every round of the phase)."""
    spec = drift.federation
    if not 0 <= index < spec.num_sites:
        raise ValueError(f"site index {index} outside the federation of {spec.num_sites} sites")
    rng = _rng(drift, 14, phase, index)
    labels = rng.permutation(phase_label_sets(drift, phase)[index])
    num_test = max(1, int(round(spec.test_fraction * labels.size)))
    x = synthesize(labels, phase_regimes(drift, phase)[index], spec.window, rng)
    return SiteArrays(x[num_test:], labels[num_test:]), SiteArrays(x[:num_test], labels[:num_test])


@functools.lru_cache(maxsize=8)
def phase_global_test(drift: DriftSpec, phase: int) -> SiteArrays:
    """Every class known in ``phase`` under every line's ``phase`` regime."""
    spec = drift.federation
    xs, ys = [], []
    for index, regime in enumerate(phase_regimes(drift, phase)):
        labels = np.repeat(np.arange(phase_classes(drift, phase)), spec.global_test_per_class)
        xs.append(synthesize(labels, regime, spec.window, _rng(drift, 15, phase, index)))
        ys.append(labels)
    return SiteArrays(np.concatenate(xs), np.concatenate(ys))


def write_phase_layout(
    out: Path,
    phases: int,
    sites: list[str],
    site_batch: Callable[[int, int], tuple[SiteArrays, SiteArrays]],
    global_test: Callable[[int], SiteArrays],
) -> None:
    """Write ``site_batch(index, phase)`` (train, test) of every site and ``global_test(phase)``
    of every phase in the on-disk phase layout (any data family)."""
    for phase in range(phases):
        sub = phase_name(phase)
        for index, site in enumerate(sites):
            train, test = site_batch(index, phase)
            folder = out / "sites" / site / sub if sub else out / "sites" / site
            write_split(folder / "train.npz", train)
            write_split(folder / "test.npz", test)
        write_split((out / sub if sub else out) / "test.npz", global_test(phase))


def write_drift_federation(drift: DriftSpec, out: str | Path) -> Path:
    """Write every phase in the on-disk phase layout (see :mod:`fedind.data.format`):
    phase 0 as the static layout, phase ``p`` under ``phase-<p>/`` folders."""
    out = Path(out)
    write_phase_layout(
        out,
        drift.phases,
        site_ids(drift.federation.num_sites),
        lambda index, phase: phase_site(drift, index, phase),
        lambda phase: phase_global_test(drift, phase),
    )
    source = new_class_site(drift)
    write_meta(
        out,
        {
            "num_classes": phase_classes(drift, 0),
            "class_names": list(CLASS_NAMES[: phase_classes(drift, 0)]),
            "new_class_names": list(CLASS_NAMES[phase_classes(drift, 0) :]),
            "phases": drift.phases,
            "generator": {"name": "fedind.data.drift", **asdict(drift)},
            "new_class_site": None if source is None else site_ids(drift.federation.num_sites)[source],
        },
    )
    return out


def _check_phase(drift: DriftSpec, phase: int) -> None:
    if not 0 <= phase < drift.phases:
        raise ValueError(f"phase {phase} outside 0..{drift.phases - 1}")
