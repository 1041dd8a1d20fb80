"""Shared bits of the simulation scripts: run config from pyproject + key=value overrides,
which runs are finished, and their figures."""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fedind.config import RunConfig
from fedind.server.app import run_folder

ROOT = Path(__file__).resolve().parents[1]


def pyproject_run_config() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["flwr"]["app"]["config"]


def parse_overrides(argv: list[str], base: dict | None = None) -> RunConfig:
    """``key=value`` pairs (TOML values, as in ``flwr run --run-config``) over pyproject's."""
    values = dict(pyproject_run_config() if base is None else base)
    # Benchmarks reuse finished runs (finished()) and start the others over, replacing what
    # an interrupted attempt left in their folders: overwrite, unless the command line says.
    values["overwrite"] = True
    for item in argv:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"expected key=value, got {item!r}")
        values[key] = _toml_value(raw)
    return RunConfig.from_flower(values)


def _toml_value(raw: str):
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # a bare word or path: take it as text


def finished(config: RunConfig) -> bool:
    """Whether ``config``'s run folder holds a summary: benchmarks reuse finished runs."""
    return (run_folder(config) / "summary.json").exists()


@contextmanager
def saved_figure(path: Path, nrows: int = 1, ncols: int = 1, **subplots) -> Iterator[tuple]:
    """``(fig, axes)`` of ``plt.subplots(nrows, ncols, **subplots)`` on the file backend
    (no display needed), laid out and written to ``path`` (110 dpi) when the block ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, **subplots)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
