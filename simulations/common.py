"""Shared bits of the simulation scripts: run config from pyproject + key=value overrides,
and which runs are finished."""

from __future__ import annotations

import tomllib
from pathlib import Path

from fedind.config import RunConfig
from fedind.serverapp import run_folder

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
