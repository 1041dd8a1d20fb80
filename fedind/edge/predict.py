"""Diagnose vibration windows with a trained model: load and verify a model file, read
windows, classify them exactly as the server's evaluation does.

A model file is a run's ``model.safetensors`` (its ``.sha256`` beside it and, in a run
folder, ``summary.json``'s ``model_sha256``, ``rounds`` and ``model_parameters``) or a
round's checkpoint folder ``checkpoints/round-<r>/`` (its manifest's SHA-256). Every digest
found is checked before the model is built; a file that does not form a
:class:`~fedind.models.FaultCNN`, or whose shape does not fit the windows, is refused with a
:class:`ModelFileError` naming the file and the fault. No pickle: safetensors, JSON, .npy/.npz.

The front end and the model are the training ones (``FaultCNN`` holds its fixed front end),
evaluated on CPU in batches of 512 in eval mode, as :func:`fedind.training.evaluate` does:
on a run's global test set the accuracy is the run's final accuracy, to the last bit.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..server.checkpoint import CorruptCheckpointError, read_checkpoint
from ..store import MANIFEST
from ..data.format import META_FILE, DataFormatError, load_split
from ..files import digest_path, read_digest

MODEL_FILE = "model.safetensors"
SUMMARY_FILE = "summary.json"
EVAL_BATCH = 512  # fedind.training.evaluate's batch: the same batches give the same floats


class ModelFileError(ValueError):
    """A model file that must not be used; the message names the file and the fault."""


class MissingDigestError(ModelFileError):
    """Nothing vouches for the file's digest yet (its ``.sha256`` may still be on its way)."""


@dataclass(frozen=True)
class LoadedModel:
    """A verified model, ready to classify (eval mode, CPU)."""

    model: torch.nn.Module
    sha256: str  # of the safetensors file the arrays came from
    round: int | None  # the server round it is the global model of, when known
    path: Path

    @property
    def num_classes(self) -> int:
        return int(self.model.head.out_features)

    @property
    def in_channels(self) -> int:
        return int(self.model.features[1].in_channels) // 3

    def describe(self) -> dict:
        return {"round": self.round, "sha256": self.sha256, "path": str(self.path), "classes": self.num_classes}


@dataclass(frozen=True)
class Windows:
    """Windows to diagnose: ``x`` float32 [N, C, L], labels ``y`` int64 [N] when known."""

    x: np.ndarray
    y: np.ndarray | None
    class_names: tuple[str, ...]  # from the data folder's meta.json; may be empty
    path: Path


# --------------------------------------------------------------------------- models


def sha256_file(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_model(path: Path, expected_sha256: str | None = None, require_digest: bool = False) -> LoadedModel:
    """Load and verify the model at ``path`` (a ``.safetensors`` file, a run folder or a
    checkpoint folder); ``expected_sha256``: a digest it must also have (e.g. from a
    summary given apart). ``require_digest``: refuse a file that nothing beside it vouches
    for (no ``.sha256``, no summary), as a watcher must. Raises :class:`ModelFileError`."""
    path = Path(path)
    if path.is_dir() and (path / MANIFEST).is_file():
        return _load_checkpoint(path, expected_sha256)
    if path.is_dir():
        if not (path / MODEL_FILE).is_file():
            raise ModelFileError(f"{path}: a folder without {MODEL_FILE} or {MANIFEST}: not a run or checkpoint folder")
        path = path / MODEL_FILE
    if (path.parent / MANIFEST).is_file() and path.name == MODEL_FILE:
        return _load_checkpoint(path.parent, expected_sha256)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ModelFileError(f"{path}: cannot read the model ({err.strerror or err})") from err
    digest = sha256_file(data)
    claims = _digest_claims(path)
    if expected_sha256:
        claims.append((expected_sha256.strip().lower(), "the expected digest"))
    if require_digest and not claims:
        raise MissingDigestError(f"{path}: no {path.name}.sha256 beside it (yet): its digest cannot be checked")
    for claimed, source in claims:
        if claimed != digest:
            raise ModelFileError(
                f"{path}: SHA-256 {digest[:16]}… does not match {source} ({claimed[:16]}…): "
                f"the file was modified, torn or belongs to another run"
            )
    summary = _summary_beside(path)
    model = model_from_bytes(data, path)
    if summary is not None:
        check_against_summary(model, summary, path)
    return LoadedModel(model, digest, _round_of(data, summary), path)


def _load_checkpoint(folder: Path, expected_sha256: str | None) -> LoadedModel:
    try:
        checkpoint = read_checkpoint(folder)  # manifest, sizes and SHA-256 of every file
    except CorruptCheckpointError as err:
        raise ModelFileError(str(err)) from err
    data = (folder / MODEL_FILE).read_bytes()
    digest = sha256_file(data)
    if expected_sha256 and expected_sha256.strip().lower() != digest:
        raise ModelFileError(f"{folder / MODEL_FILE}: SHA-256 {digest[:16]}… is not the expected {expected_sha256[:16]}…")
    return LoadedModel(model_from_bytes(data, folder / MODEL_FILE), digest, checkpoint.round, folder / MODEL_FILE)


def _digest_claims(path: Path) -> list[tuple[str, str]]:
    """The digests the files beside ``path`` claim for it: ``<name>.sha256`` and the run's summary."""
    claims = []
    sidecar = digest_path(path)
    if sidecar.is_file():
        digest = read_digest(path)
        if digest is None:
            raise ModelFileError(f"{sidecar}: empty digest file")
        claims.append((digest, sidecar.name))
    summary = _summary_beside(path)
    if summary is not None and summary.get("model_sha256"):
        claims.append((str(summary["model_sha256"]).lower(), f"{SUMMARY_FILE}'s model_sha256"))
    return claims


def _summary_beside(path: Path) -> dict | None:
    """The run's summary.json when ``path`` is that run's model.safetensors, else None."""
    summary_path = path.parent / SUMMARY_FILE
    if path.name != MODEL_FILE or not summary_path.is_file():
        return None
    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ModelFileError(f"{summary_path}: unreadable run summary ({err})") from err
    if not isinstance(summary, dict):
        raise ModelFileError(f"{summary_path}: expected a JSON object")
    return summary


def model_from_bytes(data: bytes, path: Path) -> torch.nn.Module:
    """The FaultCNN in safetensors ``data`` (strict: every tensor, shapes that fit), eval mode."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    from ..models import FaultCNN

    try:
        state = load(data)
    except (SafetensorError, ValueError, OSError) as err:
        raise ModelFileError(f"{path}: not readable safetensors ({err})") from err
    missing = [k for k in ("features.1.weight", "head.weight") if k not in state]
    if missing:
        raise ModelFileError(f"{path}: not a FaultCNN model (no {', '.join(missing)}; it holds {sorted(state)[:4]}…)")
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ModelFileError(f"{path}: {name} is not finite")
    try:
        model = FaultCNN.from_state_dict(state)
    except (RuntimeError, ValueError, KeyError) as err:
        first = str(err).strip().splitlines()
        raise ModelFileError(f"{path}: the arrays do not form a FaultCNN ({' '.join(first[:3])})") from err
    return model.eval()


def check_against_summary(model: torch.nn.Module, summary: dict, path: Path) -> None:
    """The model's size and width are those the run's summary records."""
    params = int(sum(p.numel() for p in model.state_dict().values()))
    recorded = summary.get("model_parameters")
    if recorded is not None and recorded != params:
        raise ModelFileError(f"{path}: {params} parameters, the run's {SUMMARY_FILE} records {recorded}")
    width = (summary.get("config") or {}).get("model-width")
    if width is not None and int(model.features[1].out_channels) != int(width):
        raise ModelFileError(
            f"{path}: model width {model.features[1].out_channels}, the run's {SUMMARY_FILE} has model-width {width}"
        )


def _round_of(data: bytes, summary: dict | None) -> int | None:
    """The round a model file holds: its safetensors metadata ``round``, or the run's rounds."""
    header_len = int.from_bytes(data[:8], "little")
    try:
        metadata = json.loads(data[8 : 8 + header_len]).get("__metadata__") or {}
    except ValueError:
        metadata = {}
    if str(metadata.get("round", "")).isdigit():
        return int(metadata["round"])
    if summary is not None and isinstance(summary.get("rounds"), int):
        return summary["rounds"]
    return None


# --------------------------------------------------------------------------- windows


def read_windows(path: Path) -> Windows:
    """Windows from a split ``.npz`` (x and y, checked by the site data format's rules), an
    ``.npz`` holding ``x`` alone, or an ``.npy`` array float32 [N, C, L]."""
    path = Path(path)
    if not path.is_file():
        raise DataFormatError(f"{path}: file not found")
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as err:
        raise DataFormatError(f"{path}: not a .npy or .npz array file ({err})") from err
    if isinstance(loaded, np.ndarray):
        x, y = loaded, None
    else:
        with loaded:
            files = set(loaded.files)
        if {"x", "y"} <= files:
            split = load_split(path)
            x, y = split.x, split.y
        elif "x" in files:
            with np.load(path, allow_pickle=False) as npz:
                x, y = npz["x"], None
        else:
            raise DataFormatError(f"{path}: no x array; found keys {sorted(files)}")
    check_window_array(x, path)
    return Windows(x=x, y=y, class_names=class_names_near(path), path=path)


def check_window_array(x: np.ndarray, where: object) -> None:
    """float32 [N, C, L], N, C, L >= 1, finite: the site data format's rule for ``x``."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32:
        raise DataFormatError(f"{where}: windows have dtype {getattr(x, 'dtype', type(x).__name__)}, expected float32")
    if x.ndim != 3 or x.size == 0:
        raise DataFormatError(f"{where}: windows have shape {list(x.shape)}, expected [N, C, L] with N, C, L >= 1")
    if not np.all(np.isfinite(x)):
        raise DataFormatError(f"{where}: windows contain NaN or Inf")


def class_names_near(path: Path, levels: int = 4) -> tuple[str, ...]:
    """``class_names`` (+ ``new_class_names``) of the nearest meta.json above ``path``: the
    data root of ``DATA_ROOT/test.npz``, ``DATA_ROOT/sites/<id>/test.npz`` or a phase batch."""
    for folder in list(Path(path).resolve().parents)[:levels]:
        meta = folder / META_FILE
        if meta.is_file():
            try:
                content = json.loads(meta.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                return ()
            names = list(content.get("class_names") or []) + list(content.get("new_class_names") or [])
            return tuple(str(n) for n in names)
    return ()


def check_fits(loaded: LoadedModel, windows: Windows) -> None:
    """The model can read these windows and their labels, else ModelFileError."""
    channels = windows.x.shape[1]
    if channels != loaded.in_channels:
        raise ModelFileError(
            f"{loaded.path}: the model reads {loaded.in_channels}-channel windows, "
            f"{windows.path} has {channels} channel(s)"
        )
    if windows.y is not None and int(windows.y.max()) >= loaded.num_classes:
        raise ModelFileError(
            f"{loaded.path}: the model has {loaded.num_classes} classes, {windows.path} has label {int(windows.y.max())}"
        )


# --------------------------------------------------------------------------- classification


@dataclass(frozen=True)
class Predictions:
    classes: np.ndarray  # int64 [N]
    confidence: np.ndarray  # float32 [N]: softmax probability of the predicted class


@torch.no_grad()
def classify(model: torch.nn.Module, x: np.ndarray, batch_size: int = EVAL_BATCH) -> Predictions:
    """Argmax class and its softmax probability per window, batched as the server evaluates."""
    model.eval()
    classes, confidence = [], []
    for start in range(0, len(x), batch_size):
        logits = model(torch.from_numpy(np.ascontiguousarray(x[start : start + batch_size])))
        probabilities = torch.softmax(logits.float(), dim=1)
        top = probabilities.max(dim=1)
        classes.append(logits.argmax(dim=1).numpy())
        confidence.append(top.values.numpy())
    return Predictions(np.concatenate(classes).astype(np.int64), np.concatenate(confidence).astype(np.float32))


def confusion_matrix(y: np.ndarray, predicted: np.ndarray, num_classes: int) -> np.ndarray:
    """[num_classes, num_classes] counts, rows = true class (as fedind.training.EvalResult)."""
    matrix = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(matrix, (y, predicted), 1)
    return matrix


def accuracy_of(confusion: np.ndarray) -> float:
    """Correct / total, computed as fedind.training.evaluate computes it."""
    return float(np.trace(confusion)) / max(int(confusion.sum()), 1)


def class_name(names: tuple[str, ...], index: int) -> str:
    return names[index] if index < len(names) else f"class-{index}"


def prediction_rows(windows: Windows, predictions: Predictions) -> list[dict]:
    """One dict per window: index, class, class name, confidence (and label when known)."""
    rows = []
    for i, (c, p) in enumerate(zip(predictions.classes.tolist(), predictions.confidence.tolist())):
        row = {"index": i, "class": c, "class_name": class_name(windows.class_names, c), "confidence": round(p, 6)}
        if windows.y is not None:
            row["label"] = int(windows.y[i])
        rows.append(row)
    return rows


def format_confusion(confusion: np.ndarray, names: tuple[str, ...]) -> str:
    """The confusion matrix as a text table, rows = true class, columns = predicted."""
    k = len(confusion)
    labels = [class_name(names, i) for i in range(k)]
    width = max(5, len(str(int(confusion.max()))) + 1)
    head_width = max(len(s) for s in labels)
    lines = [" " * head_width + "  " + "".join(f"{i:>{width}}" for i in range(k)) + "   <- predicted"]
    for i, row in enumerate(confusion):
        lines.append(f"{labels[i]:<{head_width}}  " + "".join(f"{int(v):>{width}}" for v in row) + f"   ({i})")
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line


def add_commands(commands) -> None:
    """Add ``predict`` to the ``fedind`` subcommands (argparse subparsers)."""
    predict = commands.add_parser(
        "predict", help="diagnose vibration windows with a trained model (CSV or JSON)",
        description="Classify every window of WINDOWS (a split .npz of the site data format, an .npz with x "
        "alone, or an .npy float32 [N, C, L]) with MODEL (a run's model.safetensors or run folder, or a "
        "checkpoint folder round-<r>/), after checking its SHA-256 against the digests beside it. With labels "
        "the accuracy and the confusion matrix follow the predictions.",
    )
    predict.add_argument("--model", required=True, type=Path, metavar="PATH", help="model file, run folder or checkpoint folder")
    predict.add_argument("windows", type=Path, metavar="WINDOWS", help=".npz or .npy windows")
    predict.add_argument("--format", choices=("csv", "json"), default="csv", help="default %(default)s")
    predict.add_argument("--out", type=Path, metavar="FILE", default=None, help="write here (default: standard output)")
    predict.add_argument("--sha256", metavar="HEX", default=None, help="a digest the model file must also have")
    predict.set_defaults(run=_predict)


def _predict(args) -> int:
    import sys

    loaded = load_model(args.model, args.sha256)
    windows = read_windows(args.windows)
    check_fits(loaded, windows)
    predictions = classify(loaded.model, windows.x)
    rows = prediction_rows(windows, predictions)
    confusion = None if windows.y is None else confusion_matrix(windows.y, predictions.classes, loaded.num_classes)
    if args.format == "json":
        document = {"model": loaded.describe(), "windows": str(windows.path), "predictions": rows}
        if confusion is not None:
            document |= {"accuracy": accuracy_of(confusion), "confusion": confusion.tolist()}
        text = json.dumps(document, indent=1) + "\n"
    else:
        text = _csv(rows)
    if args.out is None:
        sys.stdout.write(text)
    else:
        from ..files import atomic_write

        atomic_write(args.out, text.encode())
    report = sys.stderr if args.out is None else sys.stdout
    round_text = "?" if loaded.round is None else loaded.round
    print(f"model {loaded.path} (round {round_text}, sha256 {loaded.sha256[:16]}…): "
          f"{len(rows)} windows of {windows.path}", file=report)
    if confusion is not None:
        print(f"accuracy {accuracy_of(confusion):.6f} ({int(np.trace(confusion))}/{int(confusion.sum())})", file=report)
        print(format_confusion(confusion, windows.class_names), file=report)
    return 0


def _csv(rows: list[dict]) -> str:
    import csv
    import io

    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()
