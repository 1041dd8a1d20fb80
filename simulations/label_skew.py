"""Local training under label skew: plain cross-entropy vs the label-prior logit adjustment.

Same federation, model, strategy, seeds and budget (pyproject defaults plus ``key=value``
overrides); only ``logit-adjustment`` differs. Reports final and best global accuracy and
rounds to ``target-accuracy`` per seed, and the mean.

    python simulations/label_skew.py --seeds 0 1 2
    python simulations/label_skew.py dirichlet-alpha=0.1 --seeds 0 1 2 --out runs/label-skew-0.1

(``key=value`` overrides first: ``--seeds`` and ``--taus`` take every number after them.)
Writes OUT/{table.md,results.json}; runs go to OUT/runs/tau<T>-seed<N> and are reused.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulations.common import parse_overrides  # noqa: E402

from fedind.simulation import simulate  # noqa: E402


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--taus", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="runs/label-skew")
    args, overrides = parser.parse_known_args(argv)
    base = parse_overrides(overrides)
    out = Path(args.out)
    results: dict[str, list[dict]] = {}
    for tau in args.taus:
        for seed in args.seeds:
            name = f"tau{tau:g}-seed{seed}"
            folder = out / "runs" / name
            if not (folder / "summary.json").exists():
                simulate(replace(base, logit_adjustment=tau, seed=seed, run_dir=str(out / "runs"), run_name=name))
            summary = json.loads((folder / "summary.json").read_text())
            results.setdefault(f"{tau:g}", []).append(
                {k: summary[k] for k in ("final_accuracy", "best_accuracy", "rounds_to_target")} | {"seed": seed}
            )
            print(f"{name}: final {summary['final_accuracy']:.4f}", flush=True)

    lines = [
        f"{base.strategy}, {base.num_server_rounds} rounds, {base.num_sites} sites, Dirichlet alpha "
        f"{base.dirichlet_alpha}, target {base.target_accuracy}; seeds {', '.join(map(str, args.seeds))}.",
        "",
        "| logit-adjustment | final acc. per seed | mean final | best acc. per seed | rounds to target per seed |",
        "|---|---|---|---|---|",
    ]
    for tau, runs in results.items():
        finals = [r["final_accuracy"] for r in runs]
        best = ", ".join(f"{r['best_accuracy']:.3f}" for r in runs)
        reached = ", ".join(str(r["rounds_to_target"] or "–") for r in runs)
        per_seed = ", ".join(f"{x:.3f}" for x in finals)
        lines.append(f"| {tau} | {per_seed} | {statistics.fmean(finals):.3f} | {best} | {reached} |")
    table = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps({"base": base.to_flower(), "results": results}, indent=2))
    print(table)


if __name__ == "__main__":
    main(sys.argv[1:])
