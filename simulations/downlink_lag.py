"""How far the sites' copy of the model lags the global model under the compressed downlink,
for plain and predicted steps (``downlink-momentum``): the replay that set up the
benchmark of predicted steps (docs/benchmarks/plant.md, "predicted downlink steps").

    python simulations/downlink_lag.py record runs/lag-models --alpha 0.1 --seed 0
    python simulations/downlink_lag.py replay runs/lag-models --ratio 0.2 --quantization int4 --betas 0 0.3 0.5 0.9

``record`` runs the plant benchmark's recipe for one alpha and seed (``simulations/plant.py``,
head calibration off) and saves every round's global model ``G_t`` as the downlink sees it
(``G001.npz``...). ``replay`` moves a copy toward that fixed sequence with the downlink's own
step (:func:`fedind.topk.downlink.step_toward`, from :func:`~fedind.topk.downlink.predicted`)
and prints, per beta, the copy's distance to ``G_t`` as a share of ``G_t``'s move that
round (mean over rounds, and per phase of 20 rounds) and the step's bytes. The sequence
is that of plain steps: in a run the sites train from the copy, so this measures the lag,
not what the lag does to training (that is the benchmark's).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fedind.server.app as server_app  # noqa: E402
from fedind.topk.downlink import CompressedDownlink, moved_by, predicted, step_toward  # noqa: E402


def record(folder: Path, alpha: float, seed: int) -> None:
    """One plant run whose downlink saves each global model it steps toward."""
    from simulations import plant

    folder.mkdir(parents=True, exist_ok=True)

    class Recording(CompressedDownlink):
        rounds = 0

        def _advance(self, target, ratio, mode, beta=0.0):
            Recording.rounds += 1
            np.savez(folder / f"G{Recording.rounds:03d}.npz", **target)
            super()._advance(target, ratio, mode, beta)

    server_app.CompressedDownlink = Recording  # the ServerApp builds its downlink from this name
    plant.main(["--alphas", str(alpha), "--seeds", str(seed), "--variants", "recipe", "--runtime", "loopback",
                "--out", str(folder / "plant"), "head-calibration=false"])


def _norm(arrays: dict) -> float:
    return float(np.sqrt(sum(float(np.sum(np.asarray(v, np.float64) ** 2)) for v in arrays.values())))


def replay(models: list[dict], ratio: float, mode: str, beta: float) -> tuple[np.ndarray, float]:
    """Per round, ``|G_t - P_t| / |G_t - G_t-1|`` (nan where the global model did not move
    or changed shape), and the mean step bytes."""
    copy = previous = None
    lags, sizes = [], []
    for t, target in enumerate(models):
        if copy is None or any(copy[k].shape != target[k].shape for k in target):
            copy, velocity = {k: v.copy() for k, v in target.items()}, None  # sent whole (start, a grown head)
            continue
        payload, moved = step_toward(predicted(copy, velocity, beta), target, ratio, mode)
        velocity, copy = moved_by(copy, moved), moved
        sizes.append(len(payload))
        step = _norm({k: target[k] - models[t - 1][k] for k in target})
        lags.append(_norm({k: target[k] - copy[k] for k in target}) / step if step else np.nan)
    return np.asarray(lags), float(np.mean(sizes))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("record", "replay"))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--quantization", default="int4", choices=("int8", "int4", "sign"))
    parser.add_argument("--betas", type=float, nargs="+", default=[0.0, 0.5])
    args = parser.parse_args(argv)
    if args.mode == "record":
        record(args.folder, args.alpha, args.seed)
        return
    models = [dict(np.load(f)) for f in sorted(args.folder.glob("G*.npz"))]
    if len(models) < 3:
        raise SystemExit(f"{args.folder}: fewer than 3 recorded models (run 'record' first)")
    print(f"{len(models)} global models, downlink {args.ratio:g} {args.quantization}")
    for beta in args.betas:
        lags, size = replay(models, args.ratio, args.quantization, beta)
        print(f"beta {beta:g}: lag {np.nanmean(lags):.3f} of a round's move (rounds 2-20 {np.nanmean(lags[:19]):.3f}, "
              f"21-40 {np.nanmean(lags[19:]):.3f}), {size / 1e3:.1f} kB a step")


if __name__ == "__main__":
    main(sys.argv[1:])
