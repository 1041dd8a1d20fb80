"""Compression benchmark: dense float32 updates vs top-k sparse updates at several ratios.

Same federation, model, seed, strategy and budget for every run (pyproject defaults plus
any ``key=value`` overrides). Reports uplink and downlink bytes per round (serialized
Flower message contents), the uplink reduction vs dense, final / best accuracy, rounds to
``target-accuracy`` and the sites' CPU time spent compressing vs training.

    python simulations/compression.py                         # dense, 10 %, 1 %, 0.1 %
    python simulations/compression.py --ratios 0.01 seed=1

Writes runs/compression/{results.csv,table.md,compression.png}; finished runs are reused.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulations.common import parse_overrides  # noqa: E402

from fedind.simulation import simulate  # noqa: E402


def run(config, name: str, out: Path) -> tuple[dict, list[dict]]:
    config = replace(config, run_dir=str(out / "runs"), run_name=name)
    folder = out / "runs" / name
    if not (folder / "summary.json").exists():
        simulate(config)
    with open(folder / "rounds.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return json.loads((folder / "summary.json").read_text()), rows


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.01, 0.001])
    parser.add_argument("--out", default="runs/compression")
    args, overrides = parser.parse_known_args(argv)
    base = parse_overrides(overrides)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    variants = [("dense", replace(base, compression="none"))] + [
        (f"topk-{ratio:g}", replace(base, compression="topk", topk_ratio=ratio)) for ratio in args.ratios
    ]
    results = []
    for name, config in variants:
        summary, rows = run(config, name, out)
        totals = summary["totals"]
        results.append(
            {
                "variant": name,
                "uplink_bytes_per_round": totals["uplink_bytes"] / summary["rounds"],
                "downlink_bytes_per_round": totals["downlink_bytes"] / summary["rounds"],
                "final_accuracy": summary["final_accuracy"],
                "best_accuracy": summary["best_accuracy"],
                "rounds_to_target": summary["rounds_to_target"],
                "compress_share_of_training": totals["site_compress_cpu_seconds"] / totals["site_train_cpu_seconds"],
                "curve": [float(r["accuracy"]) for r in rows],
            }
        )
        print(f"{name}: final {summary['final_accuracy']:.4f}", flush=True)

    dense_up = results[0]["uplink_bytes_per_round"]
    lines = [
        f"Target accuracy {base.target_accuracy}; {base.num_server_rounds} rounds, {base.num_sites} sites, "
        f"strategy {base.strategy}, seed {base.seed}.",
        "",
        "| updates | uplink / round | vs dense | downlink / round | final acc. | best acc. | rounds to target | compress CPU / train CPU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['variant']} | {r['uplink_bytes_per_round'] / 1e3:,.1f} kB | {dense_up / r['uplink_bytes_per_round']:,.0f}× "
            f"| {r['downlink_bytes_per_round'] / 1e3:,.1f} kB | {r['final_accuracy']:.4f} | {r['best_accuracy']:.4f} "
            f"| {r['rounds_to_target'] or 'not reached'} | {100 * r['compress_share_of_training']:.2f} % |"
        )
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    with open(out / "results.csv", "w", newline="") as f:
        fields = [k for k in results[0] if k != "curve"]
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows([{k: r[k] for k in fields} for r in results])
    (out / "config.json").write_text(json.dumps({"base": base.to_flower(), "ratios": args.ratios}, indent=2))
    _plot(results, out / "compression.png")
    print(table)


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_bytes) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        ax_acc.plot(range(1, len(r["curve"]) + 1), r["curve"], label=r["variant"])
    ax_acc.set(xlabel="round", ylabel="global test accuracy", ylim=(0, 1), title="accuracy")
    ax_acc.grid(alpha=0.3)
    ax_acc.legend()
    names = [r["variant"] for r in results]
    ax_bytes.bar(names, [r["uplink_bytes_per_round"] / 1e3 for r in results])
    ax_bytes.set(ylabel="uplink kB per round (10 sites)", yscale="log", title="uplink per round (log scale)")
    ax_bytes.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main(sys.argv[1:])
