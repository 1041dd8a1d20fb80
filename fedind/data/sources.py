"""Where a site agent finds its data: a simulated partition or a folder on the plant host."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from .drift import DriftSpec, phase_global_test, phase_site
from .federation import FederationSpec, make_global_test, make_site, site_ids
from .format import (
    DataFormatError,
    SiteArrays,
    list_sites,
    load_batch,
    load_global_test,
    load_phase_test,
    load_site,
    validate_data_root,
)


@dataclass(frozen=True)
class SiteData:
    site_id: str
    train: SiteArrays
    test: SiteArrays | None


def resolve_root(path: str) -> Path:
    root = Path(path).expanduser()
    if not root.is_dir():
        raise DataFormatError(
            f"{path}: data folder not found (a relative path is resolved against "
            f"{Path.cwd()}; pass an absolute path)"
        )
    return root.resolve()


@functools.lru_cache(maxsize=64)  # one simulation worker serves many sites in turn
def site_from_partition(
    spec: FederationSpec | DriftSpec | None, data_root: str, partition_id: int, num_partitions: int, phase: int = 0
) -> SiteData:
    """Simulation: partition i is synthetic site i, or the i-th site (sorted) of data_root;
    ``phase``: its batch of that phase (a :class:`DriftSpec` for synthetic phases)."""
    if isinstance(spec, DriftSpec) and not data_root:
        if num_partitions != spec.federation.num_sites or not 0 <= partition_id < num_partitions:
            raise DataFormatError(
                f"num-sites has {spec.federation.num_sites} sites but the simulation has {num_partitions} "
                f"SuperNodes (this is partition {partition_id}): run with "
                f"--federation-config 'num-supernodes={spec.federation.num_sites}'"
            )
        train, test = phase_site(spec, partition_id, phase)
        return SiteData(site_ids(spec.federation.num_sites)[partition_id], train, test)
    if isinstance(spec, DriftSpec):
        spec = spec.federation
    if data_root:
        sites = list_sites(resolve_root(data_root))
        expected = len(sites)
    elif spec is not None:
        sites, expected = site_ids(spec.num_sites), spec.num_sites
    else:
        raise ValueError("a simulated site needs either data_root or a FederationSpec")
    if num_partitions != expected or not 0 <= partition_id < expected:
        where = f"data-root {data_root}" if data_root else "num-sites"
        raise DataFormatError(
            f"{where} has {expected} sites but the simulation has {num_partitions} SuperNodes "
            f"(this is partition {partition_id}): run with "
            f"--federation-config 'num-supernodes={expected}'"
        )
    if data_root:
        train, test = load_site(resolve_root(data_root), sites[partition_id], phase=phase)
    else:
        train, test = make_site(spec, partition_id)
    return SiteData(sites[partition_id], train, test)


@functools.lru_cache(maxsize=2)
def site_from_dir(data_dir: str, site_id: str = "", phase: int = 0) -> SiteData:
    """Deployment: ``data-dir`` is one site's folder holding train.npz (+ optional test.npz),
    and ``phase-<p>/`` batches when data arrive in phases."""
    folder = resolve_root(data_dir)
    train, test = load_batch(folder, phase)
    return SiteData(site_id or folder.name, train, test)


def global_test_set(spec: FederationSpec, data_root: str) -> SiteArrays | None:
    """The server's held-out set: data-root/test.npz, or the synthetic global test set."""
    if data_root:
        return load_global_test(resolve_root(data_root))
    return make_global_test(spec)


def phase_test_set(spec: DriftSpec, data_root: str, phase: int) -> SiteArrays | None:
    """The server's held-out set of ``phase``: data-root's, or the synthetic one."""
    if data_root:
        return load_phase_test(resolve_root(data_root), phase)
    return phase_global_test(spec, phase)


def check_data_root(data_root: str) -> dict:
    """Validate a whole data-root before round 1 (raises DataFormatError naming the file)."""
    return validate_data_root(resolve_root(data_root))
