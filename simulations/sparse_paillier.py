"""Sparse encrypted rounds vs dense encrypted rounds vs plaintext top-k: uplink bytes and accuracy.

One-phase default scenario (``RunConfig`` defaults: FedAvgM, 10 synthetic sites, top-k
ratio 1.5 %, gain 1.5, 3 warm-up rounds) plus ``key=value`` overrides, on the loopback
runtime, with a fresh 2048-bit Paillier key pair per run (``simulate()``). Variants:

- ``topk``: plaintext top-k uplink (``compression = "topk"``);
- ``dense-enc``: ``encryption = "paillier"``, every coordinate encrypted;
- ``sparse-<rule>``: ``encryption = "paillier"`` with ``compression = "topk"``: the round's
  announced set chosen by ``paillier-coordinates = <rule>`` (mixed | change | random).

    python simulations/sparse_paillier.py num-server-rounds=20 --seeds 0 1 2
    python simulations/sparse_paillier.py num-server-rounds=20 --seeds 0 1 --variants sparse-change sparse-random
    python simulations/sparse_paillier.py num-server-rounds=20 --variants sparse-mixed --sparse-ratio 0.045

``--recipe``: start from the recipe's configuration in one phase (replay, EWC and head
calibration off, as encryption requires) instead of ``RunConfig``'s defaults.

``--sparse-ratio R``: the sparse encrypted variants send ``paillier-set-ratio = R`` (runs named
``sparse-<rule>-r<R>``), the plaintext ``topk`` keeps the base ratio.

Writes OUT/{results.json,table.md,config.json} (OUT = --out, default runs/sparse-paillier);
runs go to OUT/runs/<variant>-seed<N> and finished ones are reused.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulations.common import finished, parse_overrides  # noqa: E402

from fedind.config import RunConfig, recipe  # noqa: E402
from fedind.simulation import simulate  # noqa: E402

VARIANTS = {
    "topk": dict(compression="topk"),
    "dense-enc": dict(encryption="paillier"),
    "sparse-mixed": dict(encryption="paillier", compression="topk", paillier_coordinates="mixed"),
    "sparse-change": dict(encryption="paillier", compression="topk", paillier_coordinates="change"),
    "sparse-random": dict(encryption="paillier", compression="topk", paillier_coordinates="random"),
}


def uplink_per_round(folder: Path) -> list[int]:
    with open(folder / "rounds.csv") as f:
        return [int(row["uplink_bytes"]) for row in csv.DictReader(f)]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--sparse-ratio", type=float, default=None, help="paillier-set-ratio of the sparse-* variants")
    parser.add_argument("--out", default="runs/sparse-paillier")
    parser.add_argument("--recipe", action="store_true",
                        help="the recipe's configuration in one phase instead of RunConfig's defaults (the whole "
                             "recipe under encryption: simulations/plant.py encryption=paillier)")
    args, overrides = parser.parse_known_args(argv)
    # the recipe without what needs phases: one phase of static data, as measured before
    # encryption ran the continual part (2026-12-06; docs/benchmarks/sparse-paillier.md)
    if args.recipe:
        whole = recipe()
        start = RunConfig.from_flower({**whole.to_flower(), **whole.phases_off()})
    else:
        start = RunConfig()
    defaults = {k.replace("_", "-"): v for k, v in start.to_flower().items()}
    base = replace(parse_overrides(overrides, base=defaults), device="cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({"base": asdict(base), "variants": VARIANTS}, indent=1, default=str))
    results: dict[str, list[dict]] = {}
    for variant in args.variants:
        settings = dict(VARIANTS[variant])
        if args.sparse_ratio is not None and variant.startswith("sparse-"):
            settings["paillier_set_ratio"] = args.sparse_ratio
            variant = f"{variant}-r{args.sparse_ratio:g}"
        for seed in args.seeds:
            name = f"{variant}-seed{seed}"
            config = replace(base, **settings, seed=seed, run_dir=str(out / "runs"), run_name=name)
            if not finished(config):
                simulate(config, runtime="loopback")
            folder = out / "runs" / name
            summary = json.loads((folder / "summary.json").read_text())
            up = uplink_per_round(folder)
            results.setdefault(variant, []).append({
                "seed": seed, "final_accuracy": summary["final_accuracy"], "best_accuracy": summary["best_accuracy"],
                "uplink_bytes_per_round": up, "seconds": summary["totals"]["seconds"],
            })
            print(f"{name}: final {summary['final_accuracy']:.4f}  uplink last round {up[-1] / 1e3:.1f} kB", flush=True)
    suffix = "" if args.sparse_ratio is None else f"-r{args.sparse_ratio:g}"
    (out / f"results{suffix}.json").write_text(json.dumps(results, indent=1))

    dense = results.get("dense-enc")
    dense_last = statistics.mean(r["uplink_bytes_per_round"][-1] for r in dense) if dense else None
    lines = [
        f"{base.strategy}, {base.num_server_rounds} rounds, {base.num_sites} sites, one phase, topk-ratio "
        f"{base.topk_ratio} (sparse encrypted: paillier-set-ratio {args.sparse_ratio or base.paillier_set_ratio}; warm-up "
        f"{base.topk_warmup_rounds} rounds), 2048-bit key; seeds "
        f"{', '.join(map(str, args.seeds))}.",
        "",
        "| variant | final acc. per seed | mean ± sd | uplink kB/round after warm-up | mean over the run | dense enc. / this |",
        "|---|---|---|---|---|---|",
    ]
    for variant, runs in results.items():
        finals = [r["final_accuracy"] for r in runs]
        spread = statistics.stdev(finals) if len(finals) > 1 else 0.0
        last = statistics.mean(r["uplink_bytes_per_round"][-1] for r in runs)
        mean = statistics.mean(statistics.mean(r["uplink_bytes_per_round"]) for r in runs)
        ratio = f"{dense_last / last:.0f}×" if dense_last else "–"
        lines.append(
            f"| {variant} | {', '.join(f'{a:.3f}' for a in finals)} | {statistics.mean(finals):.3f} ± {spread:.3f} "
            f"| {last / 1e3:.1f} | {mean / 1e3:.1f} | {ratio} |"
        )
    (out / f"table{suffix}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
