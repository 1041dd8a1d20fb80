"""Site data format: load, validate and write the folder that sites bring their data in.

Layout::

    DATA_ROOT/
      sites/<site-id>/train.npz   x: float32 [N, C, L]; y: int64 [N], labels in [0, num_classes)
      sites/<site-id>/test.npz    optional, same keys: the site's own evaluation split
      test.npz                    optional: held-out global test set for server-side evaluation
      meta.json                   optional: {"num_classes": K, "class_names": [...], ...}

Data that arrive in phases (run config ``phases > 1``, :mod:`fedind.continual.phases`) add one
folder per new batch; the files above are phase 0::

      sites/<site-id>/phase-<p>/train.npz   the line's batch of phase p >= 1 (test.npz optional)
      phase-<p>/test.npz                    optional: the global test set of phase p

At phase ``p`` a site trains on its newest batch: ``phase-<q>/`` with the largest
``q <= p`` that has a train.npz, else the site folder itself (a line with no new batch keeps
its last one). ``meta.json``'s ``num_classes`` is the number of classes of phase 0; a later
batch may hold labels ``>= num_classes``: a new fault class, for which the server grows the
model. A plant adds a batch by writing ``phase-<p>/train.npz`` (``write_split`` writes
atomically) before the run reaches phase ``p``.

Every ``.npz`` is read with ``allow_pickle=False`` and checked; any fault raises one
``DataFormatError`` whose message starts with the offending path, e.g.
``data/sites/line-03/train.npz: x has dtype float64, expected float32``.
Sites are taken in sorted order of ``<site-id>``; hidden entries (``.name``) and plain files
under ``sites/`` are ignored. Nothing is cast or repaired silently.
"""

from __future__ import annotations

import json
import os
import uuid
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, NoReturn

import numpy as np

SITES_DIR = "sites"
TRAIN_FILE = "train.npz"
TEST_FILE = "test.npz"
META_FILE = "meta.json"
PHASE_PREFIX = "phase-"

PathLike = str | os.PathLike

# What a corrupt or truncated archive can raise while being opened or read.
_READ_ERRORS = (OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error)


class DataFormatError(ValueError):
    """Site data on disk does not follow the format; the message names the file and the fault."""


@dataclass(frozen=True)
class SiteArrays:
    """One split: ``x`` float32 [N, C, L] windows and ``y`` int64 [N] labels."""

    x: np.ndarray
    y: np.ndarray

    @property
    def num_examples(self) -> int:
        return int(self.y.shape[0])

    @property
    def sample_shape(self) -> tuple[int, int]:
        """``(C, L)`` of one example."""
        return (int(self.x.shape[1]), int(self.x.shape[2]))


# --------------------------------------------------------------------------- splits


def load_split(
    path: PathLike,
    num_classes: int | None = None,
    sample_shape: tuple[int, int] | None = None,
) -> SiteArrays:
    """Load and check one ``.npz`` split.

    Labels must be ``>= 0`` and, when ``num_classes`` is given, ``< num_classes``;
    when ``sample_shape`` is given, every example must have that ``(C, L)``.
    """
    x, y = _read_npz(Path(path))
    _check_arrays(x, y, path, num_classes, sample_shape)
    return SiteArrays(x=x, y=y)


def write_split(path: PathLike, arrays: SiteArrays) -> None:
    """Check ``arrays`` by the loading rules, then write them atomically as an ``.npz``."""
    _check_arrays(arrays.x, arrays.y, path, None, None)
    _atomic_write(Path(path), lambda f: np.savez(f, x=arrays.x, y=arrays.y))


def _read_npz(path: Path) -> tuple[Any, Any]:
    if not path.is_file():
        fault = "is a directory, expected an .npz file" if path.is_dir() else "file not found"
        raise DataFormatError(f"{path}: {fault}")
    try:
        loaded = np.load(path, allow_pickle=False)
    except _READ_ERRORS as exc:
        raise DataFormatError(f"{path}: not a valid .npz archive ({exc})") from exc
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise DataFormatError(f"{path}: holds a single .npy array, expected an .npz archive")
    with loaded:
        missing = [key for key in ("x", "y") if key not in loaded.files]
        if missing:
            raise DataFormatError(
                f"{path}: missing key(s) {', '.join(missing)}; found keys {sorted(loaded.files)}"
            )
        return _read_member(loaded, "x", path), _read_member(loaded, "y", path)


def _read_member(npz: np.lib.npyio.NpzFile, key: str, path: Path) -> Any:
    try:
        return npz[key]
    except _READ_ERRORS as exc:
        # numpy refuses object arrays (before unpickling anything) with a ValueError
        # that mentions allow_pickle; anything else is a damaged archive.
        if "allow_pickle" in str(exc):
            fault = f"{key} is a pickled object array, refused (loaded with allow_pickle=False)"
        else:
            fault = f"cannot read {key}, archive corrupt or truncated ({exc})"
        raise DataFormatError(f"{path}: {fault}") from exc


def _check_arrays(
    x: Any,
    y: Any,
    where: PathLike,
    num_classes: int | None,
    sample_shape: tuple[int, int] | None,
) -> None:
    """Raise ``DataFormatError`` naming ``where`` at the first fault of ``(x, y)``."""

    def fail(fault: str) -> NoReturn:
        raise DataFormatError(f"{where}: {fault}")

    for key, value, dtype in (("x", x, np.float32), ("y", y, np.int64)):
        if not isinstance(value, np.ndarray):
            fail(f"{key} is {type(value).__name__}, expected a numpy array")
        if value.dtype != dtype:
            fail(f"{key} has dtype {_dtype_name(value.dtype)}, expected {np.dtype(dtype).name}")
    if x.ndim != 3:
        fail(f"x has shape {x.shape} ({x.ndim}-D), expected 3-D [N, C, L]")
    if y.ndim != 1:
        fail(f"y has shape {y.shape} ({y.ndim}-D), expected 1-D [N]")
    if len(x) != len(y):
        fail(f"length mismatch: x has {len(x)} examples, y has {len(y)} labels")
    if x.size == 0:
        fail(f"x is empty (shape {x.shape}), expected N, C, L >= 1")
    if sample_shape is not None and x.shape[1:] != tuple(sample_shape):
        fail(f"sample shape [C, L] is {list(x.shape[1:])}, expected {list(sample_shape)}")
    non_finite = int(x.size - np.count_nonzero(np.isfinite(x)))
    if non_finite:
        fail(f"x contains {non_finite} NaN or Inf value(s)")
    _check_labels(y, num_classes, fail)


def _check_labels(y: np.ndarray, num_classes: int | None, fail: Callable[[str], NoReturn]) -> None:
    bad = y < 0 if num_classes is None else (y < 0) | (y >= num_classes)
    if bad.any():
        index = int(np.flatnonzero(bad)[0])
        valid = "labels >= 0" if num_classes is None else f"labels in [0, {num_classes})"
        fail(
            f"{int(bad.sum())} label(s) out of range, first is y[{index}] = {int(y[index])}; "
            f"expected {valid}"
        )


def _dtype_name(dtype: np.dtype) -> str:
    return dtype.name if dtype.isnative else dtype.str


# --------------------------------------------------------------------------- data root


def load_meta(data_root: PathLike) -> dict:
    """Read ``DATA_ROOT/meta.json``; ``{}`` when it is absent."""
    path = _root(data_root) / META_FILE
    if not path.exists():
        return {}
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise DataFormatError(f"{path}: cannot read ({exc})") from exc
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise DataFormatError(f"{path}: invalid JSON ({exc})") from exc
    _check_meta(meta, path)
    return meta


def write_meta(data_root: PathLike, meta: dict) -> None:
    """Check ``meta`` by the loading rules, then write ``DATA_ROOT/meta.json`` atomically."""
    path = Path(data_root) / META_FILE
    _check_meta(meta, path)
    try:
        text = json.dumps(meta, indent=2, allow_nan=False) + "\n"
    except (TypeError, ValueError) as exc:
        raise DataFormatError(f"{path}: meta is not JSON-serialisable ({exc})") from exc
    _atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def _check_meta(meta: Any, path: Path) -> None:
    if not isinstance(meta, dict):
        raise DataFormatError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    num_classes = meta.get("num_classes")
    if "num_classes" in meta and not (_is_int(num_classes) and num_classes > 0):
        raise DataFormatError(f"{path}: num_classes must be a positive int, got {num_classes!r}")
    if "class_names" in meta:
        names = meta["class_names"]
        if not (isinstance(names, list) and all(isinstance(name, str) for name in names)):
            raise DataFormatError(f"{path}: class_names must be a list of str, got {names!r}")
        if num_classes is not None and len(names) != num_classes:
            raise DataFormatError(
                f"{path}: class_names has {len(names)} names, expected num_classes = {num_classes}"
            )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _declared_num_classes(meta: dict) -> int | None:
    """``num_classes`` from meta.json, else the length of ``class_names``, else None."""
    if "num_classes" in meta:
        return meta["num_classes"]
    if "class_names" in meta:
        return len(meta["class_names"])
    return None


def list_sites(data_root: PathLike) -> list[str]:
    """Sorted site ids: the directories under ``DATA_ROOT/sites/``; each must hold train.npz."""
    sites_dir = _root(data_root) / SITES_DIR
    if not sites_dir.is_dir():
        raise DataFormatError(f"{sites_dir}: directory not found, expected one directory per site")
    site_dirs = sorted(p for p in sites_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not site_dirs:
        raise DataFormatError(f"{sites_dir}: no site directories, expected <site-id>/{TRAIN_FILE}")
    for site_dir in site_dirs:
        if not (site_dir / TRAIN_FILE).is_file():
            raise DataFormatError(f"{site_dir}: site directory has no {TRAIN_FILE} (half copied?)")
    return [p.name for p in site_dirs]


def load_site(
    data_root: PathLike,
    site_id: str,
    num_classes: int | None = None,
    sample_shape: tuple[int, int] | None = None,
    phase: int = 0,
) -> tuple[SiteArrays, SiteArrays | None]:
    """Train split and optional test split of one site; both must share one ``(C, L)``.
    ``phase > 0``: the site's newest batch at that phase (:func:`batch_dir`), whose labels
    may exceed ``num_classes`` (new classes)."""
    return load_batch(_site_dir(_root(data_root), site_id), phase, num_classes, sample_shape)


def phase_name(phase: int) -> str:
    """Folder of a phase's batch: ``""`` for phase 0 (the static layout), else ``phase-<p>``."""
    if not _is_int(phase) or phase < 0:
        raise ValueError(f"Invalid phase: {phase!r}")
    return f"{PHASE_PREFIX}{phase}" if phase else ""


def batch_dir(site_dir: PathLike, phase: int) -> Path:
    """The folder of a site's newest batch at ``phase``: ``phase-<q>/`` with the largest
    ``q <= phase`` that holds a train.npz, else ``site_dir`` (phase 0)."""
    site_dir = Path(site_dir)
    for q in range(phase, 0, -1):
        if (site_dir / phase_name(q) / TRAIN_FILE).is_file():
            return site_dir / phase_name(q)
    return site_dir


def load_batch(
    site_dir: PathLike,
    phase: int = 0,
    num_classes: int | None = None,
    sample_shape: tuple[int, int] | None = None,
) -> tuple[SiteArrays, SiteArrays | None]:
    """Train and optional test split of a site's newest batch at ``phase`` (one site's
    folder, as a deployed site agent's ``data-dir``). ``num_classes`` bounds the labels of
    phase 0 only: later batches may bring new classes."""
    folder = batch_dir(site_dir, phase)
    bound = num_classes if folder == Path(site_dir) else None
    train = load_split(folder / TRAIN_FILE, bound, sample_shape)
    test_path = folder / TEST_FILE
    test = load_split(test_path, bound, train.sample_shape) if test_path.exists() else None
    return train, test


def load_phase_test(
    data_root: PathLike, phase: int, sample_shape: tuple[int, int] | None = None
) -> SiteArrays | None:
    """The global test set of ``phase``: ``DATA_ROOT/test.npz`` (phase 0) or
    ``DATA_ROOT/phase-<p>/test.npz``; None when absent."""
    path = _root(data_root) / phase_name(phase) / TEST_FILE
    return load_split(path, None, sample_shape) if path.exists() else None


def validate_phases(data_root: PathLike, phases: int) -> dict:
    """Check every batch of phases ``1 .. phases-1`` (files present: each site's
    ``phase-<p>/`` splits, ``phase-<p>/test.npz``) against phase 0's ``(C, L)``.

    Returns ``{"max_label": int, "batches": {site: [phases with a batch]},
    "phase_tests": [phases with a global test set]}`` (phase 0 included)."""
    root = _root(data_root)
    info = validate_data_root(root)
    shape = tuple(info["sample_shape"])
    max_label = info["num_classes"] - 1
    batches = {site: [0] for site in info["sites"]}
    phase_tests = [0] if info["has_global_test"] else []
    for phase in range(1, phases):
        for site in info["sites"]:
            folder = root / SITES_DIR / site / phase_name(phase)
            if not (folder / TRAIN_FILE).is_file():
                if folder.exists():
                    raise DataFormatError(f"{folder}: batch folder has no {TRAIN_FILE} (half copied?)")
                continue
            train, test = load_batch(root / SITES_DIR / site, phase, None, shape)
            max_label = max([max_label, int(train.y.max())] + ([int(test.y.max())] if test is not None else []))
            batches[site].append(phase)
        test = load_phase_test(root, phase, shape)
        if test is not None:
            max_label = max(max_label, int(test.y.max()))
            phase_tests.append(phase)
    return {"max_label": max_label, "batches": batches, "phase_tests": phase_tests}


def load_global_test(
    data_root: PathLike,
    num_classes: int | None = None,
    sample_shape: tuple[int, int] | None = None,
) -> SiteArrays | None:
    """The server's held-out ``DATA_ROOT/test.npz``, or None when absent."""
    path = _root(data_root) / TEST_FILE
    return load_split(path, num_classes, sample_shape) if path.exists() else None


def infer_num_classes(data_root: PathLike) -> int:
    """``num_classes`` from meta.json if declared, else 1 + the largest label in any split."""
    declared = _declared_num_classes(load_meta(data_root))
    return declared if declared is not None else validate_data_root(data_root)["num_classes"]


def validate_data_root(data_root: PathLike) -> dict:
    """Check the whole tree (meta, every split, one ``(C, L)``, labels) and summarise it.

    Returns ``{"sites", "num_classes", "sample_shape", "num_train", "has_global_test",
    "num_classes_from", "absent_labels"}``: ``num_classes_from`` is ``"meta.json"`` or
    ``"labels"`` (1 + the largest label, when meta.json declares no class count), and
    ``absent_labels`` lists the labels below ``num_classes`` that no split holds (with an
    inferred count, a long run of them usually means one stray label).
    """
    root = _root(data_root)
    sites = list_sites(root)
    num_classes = _declared_num_classes(load_meta(root))
    sample_shape = None
    present: set[int] = set()
    num_examples: dict[Path, int] = {}
    for path in _split_paths(root, sites):
        arrays = load_split(path, num_classes, sample_shape)
        sample_shape = arrays.sample_shape
        present.update(int(label) for label in np.unique(arrays.y))
        num_examples[path] = arrays.num_examples
    classes = num_classes if num_classes is not None else max(present) + 1
    return {
        "sites": sites,
        "num_classes": classes,
        "sample_shape": list(sample_shape),
        "num_train": {site: num_examples[root / SITES_DIR / site / TRAIN_FILE] for site in sites},
        "has_global_test": (root / TEST_FILE).exists(),
        "num_classes_from": META_FILE if num_classes is not None else "labels",
        "absent_labels": sorted(set(range(classes)) - present),
    }


def _split_paths(root: Path, sites: list[str]) -> list[Path]:
    """Every split present: each site's train (and test), then the global test."""
    paths = []
    for site in sites:
        paths.append(root / SITES_DIR / site / TRAIN_FILE)
        if (root / SITES_DIR / site / TEST_FILE).exists():
            paths.append(root / SITES_DIR / site / TEST_FILE)
    if (root / TEST_FILE).exists():
        paths.append(root / TEST_FILE)
    return paths


def _root(data_root: PathLike) -> Path:
    root = Path(data_root)
    if not root.is_dir():
        raise DataFormatError(f"{root}: data root directory not found")
    return root


def _site_dir(root: Path, site_id: str) -> Path:
    if site_id in ("", ".", "..") or any(sep in site_id for sep in "/\\"):
        raise DataFormatError(f"{root / SITES_DIR}: invalid site id {site_id!r}")
    return root / SITES_DIR / site_id


# --------------------------------------------------------------------------- atomic write


def _atomic_write(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """Write via a temp file in the same directory, fsync, then ``os.replace`` onto ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable (POSIX only; Windows has no directory fsync)."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
