"""Centralized upper bound on the default scenario (or any run config).

    python simulations/centralized.py                      # pyproject defaults
    python simulations/centralized.py dirichlet-alpha=0.1 seed=1

Writes runs/centralized/<name>.json with the accuracy curve and the config used.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulations.common import parse_overrides  # noqa: E402

from fedind.centralized import train_centralized_many  # noqa: E402


def main(argv: list[str]) -> None:
    config = parse_overrides(argv)
    started = time.time()
    (result,) = train_centralized_many([config], log_every=10)  # one torch thread, as in the benchmarks
    out = Path(config.run_dir) / "centralized"
    out.mkdir(parents=True, exist_ok=True)
    name = f"alpha{config.dirichlet_alpha}-sites{config.num_sites}-seed{config.seed}.json"
    (out / name).write_text(json.dumps({**result, "config": config.to_flower(), "seconds": time.time() - started}, indent=2))
    print(
        f"centralized upper bound: final {result['final_accuracy']:.4f}, best {result['best_accuracy']:.4f} "
        f"({result['train_examples']} windows, {result['epochs']} epochs, {time.time() - started:.0f} s) -> {out / name}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
