"""Compression benchmark: dense float32 updates vs top-k sparse updates at several ratios.

Same federation, model, seeds, strategy and budget for every run (pyproject defaults plus
any ``key=value`` overrides). Reports uplink and downlink bytes per round (serialized
Flower message contents, all sites), the uplink reduction vs dense, final / best accuracy
(mean ± std over seeds) and the difference to the dense run of the same seed, rounds to
``target-accuracy`` and the sites' CPU time spent compressing vs training.

    python simulations/compression.py                      # dense; 10 %, 1 %, 0.1 % with each feedback
    python simulations/compression.py --ratios 0.015 --seeds 0 1 2 --feedbacks estimate

(``key=value`` overrides first: ``--ratios``, ``--seeds`` and ``--feedbacks`` take every
value after them.) ``--feedbacks``: ``residual`` (classic error feedback, runs named
``topk-<ratio>``) and/or ``estimate`` (EF21, ``topk-ef21-<ratio>``).

Writes OUT/{results.csv,table.md,config.json,compression.png} (OUT = --out,
runs/compression by default); each run's folder is OUT/runs/<variant>-seed<N>, and
finished runs are reused, so an interrupted benchmark picks up where it stopped.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulations.common import finished, parse_overrides, saved_figure  # noqa: E402

from fedind.server.app import run_folder  # noqa: E402
from fedind.simulation import simulate_many  # noqa: E402


# Run folder / table name of a top-k variant, by topk-feedback.
VARIANT_NAME = {"residual": "topk-{ratio:g}", "estimate": "topk-ef21-{ratio:g}"}


def measure(config) -> dict:
    """One finished run's figures."""
    folder = run_folder(config)
    with open(folder / "rounds.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    summary = json.loads((folder / "summary.json").read_text())
    totals = summary["totals"]
    return {
        "uplink_bytes_per_round": totals["uplink_bytes"] / summary["rounds"],
        "steady_uplink_bytes_per_round": _steady_uplink(rows, config),
        "downlink_bytes_per_round": totals["downlink_bytes"] / summary["rounds"],
        "final_accuracy": summary["final_accuracy"],
        "best_accuracy": summary["best_accuracy"],
        "rounds_to_target": summary["rounds_to_target"],
        "compress_share_of_training": totals["site_compress_cpu_seconds"] / totals["site_train_cpu_seconds"],
        "curve": [float(r["accuracy"]) for r in rows],
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.01, 0.001])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--feedbacks", nargs="+", choices=sorted(VARIANT_NAME), default=["residual", "estimate"],
                        help="topk-feedback kinds to run at every ratio")
    parser.add_argument("--out", default="runs/compression")
    args, overrides = parser.parse_known_args(argv)
    base = parse_overrides(overrides)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    variants = [("dense", replace(base, compression="none"))] + [
        (VARIANT_NAME[feedback].format(ratio=ratio),
         replace(base, compression="topk", topk_ratio=ratio, topk_feedback=feedback))
        for feedback in args.feedbacks for ratio in args.ratios
    ]
    # Every run not yet finished, in one simulation (one Ray start).
    configs = {
        (seed, name): replace(config, seed=seed, run_dir=str(out / "runs"), run_name=f"{name}-seed{seed}")
        for seed in args.seeds for name, config in variants
    }
    simulate_many([c for c in configs.values() if not finished(c)])
    per_run: dict[str, list[dict]] = {name: [] for name, _ in variants}
    for seed in args.seeds:
        for name, _ in variants:
            figures = measure(configs[(seed, name)])
            per_run[name].append({"seed": seed, **figures})
            print(f"{name} seed {seed}: final {figures['final_accuracy']:.4f}", flush=True)

    dense = per_run["dense"]
    results = [_summarise(name, runs, dense) for name, runs in per_run.items()]
    table = _table(results, base, args.seeds)
    (out / "table.md").write_text(table + "\n")
    with open(out / "results.csv", "w", newline="") as f:
        fields = [k for k in per_run["dense"][0] if k != "curve"]
        writer = csv.DictWriter(f, fieldnames=["variant", *fields])
        writer.writeheader()
        for name, runs in per_run.items():
            writer.writerows([{"variant": name, **{k: r[k] for k in fields}} for r in runs])
    (out / "config.json").write_text(
        json.dumps({"base": base.to_flower(), "ratios": args.ratios, "seeds": args.seeds}, indent=2)
    )
    _plot(results, out / "compression.png")
    print(table)


def _summarise(name: str, runs: list[dict], dense: list[dict]) -> dict:
    """Means over seeds; accuracy differences are taken against dense seed by seed."""

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in runs)

    finals = [r["final_accuracy"] for r in runs]
    return {
        "variant": name,
        "uplink": mean("uplink_bytes_per_round"),
        "steady_uplink": mean("steady_uplink_bytes_per_round"),
        "downlink": mean("downlink_bytes_per_round"),
        "final": statistics.fmean(finals),
        "final_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
        "vs_dense": statistics.fmean(r["final_accuracy"] - d["final_accuracy"] for r, d in zip(runs, dense)),
        "best": mean("best_accuracy"),
        "rounds_to_target": [r["rounds_to_target"] for r in runs],
        "compress_share": mean("compress_share_of_training"),
        "curve": [statistics.fmean(c) for c in zip(*(r["curve"] for r in runs))],
    }


def _table(results: list[dict], base, seeds: list[int]) -> str:
    dense_up = results[0]["uplink"]
    lines = [
        f"Target accuracy {base.target_accuracy}; {base.num_server_rounds} rounds, {base.num_sites} sites, "
        f"strategy {base.strategy}, seeds {', '.join(map(str, seeds))}; quantisation {base.topk_quantization}, "
        f"sparsity warm-up {base.topk_warmup_rounds} rounds, residual decay {base.topk_residual_decay:g} "
        "(topk-*: classic error feedback; topk-ef21-*: EF21 estimates).",
        "",
        "| updates | uplink / round (mean) | vs dense | after warm-up | downlink / round | final acc. "
        "| final − dense | best acc. | rounds to target | compress CPU / train CPU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        std = f" ± {r['final_std']:.4f}" if len(seeds) > 1 else ""
        reached = ", ".join(str(x) if x else "–" for x in r["rounds_to_target"])
        lines.append(
            f"| {r['variant']} | {r['uplink'] / 1e3:,.1f} kB | {dense_up / r['uplink']:,.0f}× "
            f"| {r['steady_uplink'] / 1e3:,.1f} kB | {r['downlink'] / 1e3:,.1f} kB | {r['final']:.4f}{std} "
            f"| {100 * r['vs_dense']:+.1f} pp | {r['best']:.4f} | {reached} | {100 * r['compress_share']:.2f} % |"
        )
    return "\n".join(lines)


def _steady_uplink(rows: list[dict], config) -> float:
    """Median uplink bytes of the rounds after the sparsity warm-up (all rounds if dense)."""
    warmup = config.topk_warmup_rounds if config.compression == "topk" else 0
    after = [float(r["uplink_bytes"]) for r in rows[warmup:]] or [float(r["uplink_bytes"]) for r in rows]
    return float(statistics.median(after))


def _plot(results: list[dict], path: Path) -> None:
    with saved_figure(path, 1, 2, figsize=(11, 4)) as (fig, (ax_acc, ax_bytes)):
        for r in results:
            ax_acc.plot(range(1, len(r["curve"]) + 1), r["curve"], label=r["variant"])
        ax_acc.set(xlabel="round", ylabel="global test accuracy (mean over seeds)", ylim=(0, 1), title="accuracy")
        ax_acc.grid(alpha=0.3)
        ax_acc.legend()
        names = [r["variant"] for r in results]
        ax_bytes.bar(names, [r["uplink"] / 1e3 for r in results])
        ax_bytes.set(ylabel="uplink kB per round (all sites)", yscale="log", title="uplink per round (log scale)")
        ax_bytes.grid(alpha=0.3, axis="y")


if __name__ == "__main__":
    main(sys.argv[1:])
