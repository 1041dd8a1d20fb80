"""A site's conditioned training windows on disk, so a fresh ClientApp process skips the front end.

Flower 1.42 starts one ``flwr-clientapp`` process per message, so whatever the train handler
computes from the site's data alone is paid again every round. The fixed front end
(:meth:`fedind.models.FaultCNN.condition`) is such a computation. With ``state-dir`` in the
node config the handler keeps its result in ``state-dir/conditioned/<key>.safetensors``::

    key      SHA-256 of the windows (dtype, shape, bytes) and of the conditioning
             parameters: the front end's source code, torch's version, the device type
    metadata {"format": "fedind.conditioned", "version": "1", "key": key,
              "sha256": SHA-256 of the stored tensor's bytes}

New windows (a new batch, an edited train.npz) or a changed front end, torch or device give a
new key, so a stale file is never looked up. A file whose metadata or tensor does not match
is logged (WARNING), deleted and recomputed, never used. Files are written atomically
(:func:`fedind.files.atomic_write`); writing one removes the other keys' files (a site trains
on one batch at a time). Safetensors only, no pickle. The numbers are those of computing the
front end in the process (``tests/test_site_cache.py`` compares trained models' digests).
"""

from __future__ import annotations

import hashlib
import inspect
import json
from logging import WARNING
from pathlib import Path

import numpy as np
import torch
from flwr.common.logger import log
from safetensors import SafetensorError, safe_open

from ..files import atomic_write
from ..training import condition_windows

CACHE_DIR = "conditioned"
FORMAT, VERSION = "fedind.conditioned", "1"
TENSOR = "windows"


def conditioning_params(model: torch.nn.Module, device: torch.device) -> dict:
    """What the conditioned windows depend on besides the windows: the front end's code
    (its module's source, so an edit invalidates), torch's version and the device type
    (CPU and CUDA kernels round differently)."""
    front_end = inspect.getmodule(type(model.features[0]))
    return {
        "front_end": hashlib.sha256(inspect.getsource(front_end).encode()).hexdigest(),
        "torch": torch.__version__,
        "device": device.type,
    }


def cache_key(x: np.ndarray, params: dict) -> str:
    """SHA-256 over the windows' dtype, shape and bytes and the conditioning ``params``."""
    digest = hashlib.sha256()
    digest.update(json.dumps({"dtype": str(x.dtype), "shape": list(x.shape), "params": params}, sort_keys=True).encode())
    digest.update(np.ascontiguousarray(x).data)
    return digest.hexdigest()


def _tensor_sha256(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).data).hexdigest()


def encode_windows(z: np.ndarray, key: str) -> bytes:
    """The cache file's bytes: ``z`` with the key and its own SHA-256 in the metadata."""
    from safetensors.numpy import save

    metadata = {"format": FORMAT, "version": VERSION, "key": key, "sha256": _tensor_sha256(z)}
    return save({TENSOR: np.ascontiguousarray(z)}, metadata=metadata)


def read_windows(path: Path, key: str) -> np.ndarray:
    """The windows stored in ``path`` for ``key``; ``ValueError`` naming the file and the
    fault when its metadata or content does not match."""
    try:
        with safe_open(str(path), framework="np") as f:
            meta = f.metadata() or {}
            z = f.get_tensor(TENSOR)
    except (SafetensorError, OSError, KeyError, ValueError) as err:
        raise ValueError(f"{path}: unreadable ({err})") from err
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"{path}: not a {FORMAT} v{VERSION} file (metadata {meta})")
    if meta.get("key") != key:
        raise ValueError(f"{path}: made for key {meta.get('key')}, expected {key}")
    if meta.get("sha256") != _tensor_sha256(z):
        raise ValueError(f"{path}: content does not match its SHA-256")
    return z


def cached_conditioning(
    state_dir: str | Path, model: torch.nn.Module, x: np.ndarray, device: torch.device
) -> torch.Tensor | None:
    """``condition_windows(model, x)`` on ``device``, from ``state_dir``'s cache when a
    verified file holds it, else computed and stored. None for a model without a fixed
    front end or no windows (nothing to cache)."""
    if not hasattr(model, "condition") or not len(x):
        return None
    key = cache_key(x, conditioning_params(model, device))
    folder = Path(state_dir) / CACHE_DIR
    path = folder / f"{key}.safetensors"
    if path.exists():
        try:
            return torch.from_numpy(read_windows(path, key)).to(device)
        except ValueError as err:
            log(WARNING, "conditioned-window cache not used, recomputing: %s", err)
            path.unlink(missing_ok=True)
    z = condition_windows(model, torch.from_numpy(x).to(device))
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(path, encode_windows(z.cpu().numpy(), key))
    for stale in folder.glob("*.safetensors"):
        if stale != path:
            stale.unlink(missing_ok=True)
    return z
