"""Plant benchmark: fedind's recipe against Flower's built-in strategies, and each part's ablation.

One scenario holds what a plant has at once (``SCENARIO`` over the pyproject defaults):
10 lines with strongly Non-IID labels (Dirichlet ``--alphas``) and their own regimes; two
phases, where half the lines change speed (regime drift) and a new fault class appears at
one line; one line off the network for ``ABSENT_ROUNDS``; every byte on the wire counted.

Variants (``VARIANTS``; the recipe is the pyproject defaults, ``strategy = "fedind"``):
- Flower's FedAvg, FedAvgM, FedProx, FedAdam, FedMedian, FedTrimmedAvg: dense both ways, no
  replay, no EWC (federated fine-tuning), fedind's default local training (2 epochs a round;
  the recipe trains 3), and ``FedAvg-3ep``: FedAvg with the recipe's 3;
- each fedind part alone on top of FedAvgM (``FedAvgM+<part>``);
- the recipe, and the recipe without each part (``recipe-<part>``).

Per variant and seed: final global accuracy (test sets of every phase so far), the worst
line's accuracy (each line scores the final model on its own test split), rounds to
the target, uplink MB to the target and in total, downlink MB, all traffic, forgetting of
phase 0, recall of the new class (mean of the last 5 rounds) and the final model's
precision on it, the mean round-to-round change of the accuracy, the sites' CPU seconds
and the site agent's peak memory (its process's peak RSS: with ``--runtime loopback``
every site runs in the benchmark's own process, so it is that process's peak). Rounds to
target count to 90 % of FedAvg's mean final accuracy at that alpha (the same bar for every
variant). Means over seeds with the spread, per-seed rows in results.json.

    python simulations/plant.py --alphas 0.1 0.3 --seeds 5 6 7 8 9            # the evidence
    python simulations/plant.py --alphas 0.1 --seeds 0 --variants FedAvgM recipe  # a quick look
    python simulations/plant.py --family gearbox --alphas 0.1 --seeds 5 6       # the second data family
    python simulations/plant.py --alphas 0.3 --variants recipe --target 0.3=0.459   # FedAvg's target, not rerun

Extra ``key=value`` arguments override the run config of every run (but not a key the
variant sets itself, e.g. the built-ins' ``local-epochs``). Writes
OUT/{results.json,table.md,config.json,plant.png}; runs go to OUT/runs/<variant>-a<alpha>-s<seed>
and finished runs are reused, so an interrupted benchmark resumes where it stopped.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from flwr.app import Context, Error, Message, MessageType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulations.common import finished, parse_overrides, pyproject_run_config, saved_figure  # noqa: E402

from fedind import wire  # noqa: E402
from fedind.site.app import site_app  # noqa: E402
from fedind.config import RECIPE, RunConfig  # noqa: E402
from fedind.continual.phases import known  # noqa: E402
from fedind.data.sources import phase_test_set  # noqa: E402
from fedind.edge.predict import load_model  # noqa: E402
from fedind.training import evaluate  # noqa: E402
from fedind.simulation import simulate_many  # noqa: E402

TARGET_SHARE = 0.9  # rounds to target: to 90 % of FedAvg's mean final accuracy at that alpha
SCENARIO = {"num-sites": 10}  # the rest (phases, drift, rounds) is the default run's: pyproject
ABSENT_SITE = 3  # partition id of the line that goes off the network...
ABSENT_ROUNDS = range(8, 15)  # ...for these rounds (phase 0, before the target is usually reached)

# Flower's built-ins as a plant would run them: fedind's default site training (RunConfig's
# local-epochs, 2; the recipe trains 3; no time stretch), dense both ways, no replay, no EWC,
# no head calibration, the global model itself served.
DENSE = {"local_epochs": RunConfig.local_epochs, "local_stretch": RunConfig.local_stretch, "compression": "none",
         "downlink": "none", "replay_samples": 0, "ewc_lambda": 0.0, "head_calibration": False, "served_ema": 0.0}
BUILTINS = {
    "FedAvg": {"strategy": "fedavg", **DENSE},
    "FedAvgM": {"strategy": "fedavgm", **DENSE},
    "FedProx": {"strategy": "fedprox", **DENSE},
    "FedAdam": {"strategy": "fedadam", **DENSE},
    "FedMedian": {"strategy": "fedmedian", **DENSE},
    "FedTrimmedAvg": {"strategy": "fedtrimmedavg", **DENSE},
    f"FedAvg-{RECIPE['local_epochs']}ep": {"strategy": "fedavg", **DENSE, "local_epochs": RECIPE["local_epochs"]},  # FedAvg with the recipe's local work
}
# A part removed from the recipe, and the same part added to dense FedAvgM fine-tuning.
PARTS = {
    "DWA": ({"strategy": "fedavgm"}, {"strategy": "fedind", "conflict_buffer": False}),
    "conflict": ({"conflict_buffer": False}, {"strategy": "fedind", "dwa_weighting": False}),
    "topk": ({"compression": "none"}, {"compression": "topk"}),
    "downlink": ({"downlink": "none"}, {"downlink": "topk"}),
    "replay": ({"replay_samples": 0}, {"replay_samples": None}),  # None: the recipe's value
    "EWC": ({"ewc_lambda": 0.0}, {"ewc_lambda": None}),
    "calibration": ({"head_calibration": False}, {"head_calibration": True}),
    "stretch": ({"local_stretch": RunConfig.local_stretch}, {"local_stretch": None}),
    "served": ({"served_ema": 0.0}, {"served_ema": None}),
    "screen": ({"alignment_threshold": -1.0, "consensus_threshold": -1.0}, {}),  # the screen's rules across rounds are on in every variant but this
}
VARIANTS: dict[str, dict] = {
    **BUILTINS,
    **{f"FedAvgM+{part}": {**BUILTINS["FedAvgM"], **add} for part, (_, add) in PARTS.items() if add},
    "recipe": {},
    **{f"recipe-{part}": remove for part, (remove, _) in PARTS.items()},
}


def variant_config(base: RunConfig, name: str, alpha: float, seed: int, out: Path) -> RunConfig:
    overrides = {k: getattr(base, k) if v is None else v for k, v in VARIANTS[name].items()}
    return replace(
        base, **overrides, dirichlet_alpha=alpha, seed=seed, run_dir=str(out / "runs"),
        run_name=f"{name}-a{alpha:g}-s{seed}", checkpoint_interval=0,
    )


def gearbox_root(out: Path, base: RunConfig, alpha: float, seed: int) -> str:
    """The plant scenario on the gearbox family (fedind.data.gearbox), written once per
    alpha and seed (with ``data-root`` the folder decides the data, so it is one per seed)."""
    from fedind.data.gearbox import GearboxSpec, write_gearbox_federation

    folder = (out / "data" / f"gearbox-a{alpha:g}-s{seed}").resolve()
    if not (folder / "meta.json").exists():
        spec = GearboxSpec(num_sites=base.num_sites, alpha=alpha, samples_per_site=base.samples_per_site, seed=seed,
                           phases=base.phases, regime_share=base.drift_regime_share,
                           new_classes=base.drift_new_classes, speed_factor=base.drift_speed_factor)
        write_gearbox_federation(spec, folder)
    return str(folder)


def absent_mod(msg: Message, context: Context, call_next) -> Message:
    """The line of partition ``ABSENT_SITE`` is off the network in ``ABSENT_ROUNDS``: its
    train messages fail as a dropped connection would (the server gets no update)."""
    if msg.metadata.message_type == MessageType.TRAIN and int(context.node_config.get("partition-id", -1)) == ABSENT_SITE:
        server_round = int(msg.content[wire.CONFIG][wire.SERVER_ROUND])
        if server_round in ABSENT_ROUNDS:
            return Message(Error(code=wire.SITE_ABSENT, reason=f"line off the network in round {server_round}"), reply_to=msg)
    return call_next(msg, context)


def measure(config: RunConfig) -> dict:
    folder = Path(config.run_dir) / config.run_name
    summary = json.loads((folder / "summary.json").read_text())
    rows = _csv(folder / "rounds.csv")
    phases = _csv(folder / "phases.csv") if (folder / "phases.csv").exists() else []
    accuracy = [float(r["accuracy"]) for r in rows]
    uplink = [int(r["uplink_bytes"]) for r in rows]
    downlink = [int(r["downlink_bytes"]) for r in rows]
    continual = summary.get("continual", {})
    new_class = [float(r["new_class_accuracy"]) for r in phases if r.get("new_class_accuracy")]
    per_site = summary["per_site"]
    return {
        "final_accuracy": summary["final_accuracy"],
        "worst_line": min(v["accuracy"] for v in per_site.values()) if per_site else None,
        "uplink_mb": sum(uplink) / 1e6,
        "downlink_mb": summary["totals"]["downlink_bytes"] / 1e6,
        "forgetting": continual.get("forgetting"),
        "new_class_recall": statistics.fmean(new_class[-5:]) if new_class else None,
        "new_class_precision": new_class_precision(config, folder),
        "swing": round_swing(accuracy),
        "site_cpu_seconds": summary["totals"]["site_train_cpu_seconds"] + summary["totals"]["site_compress_cpu_seconds"],
        "site_peak_mb": summary["totals"].get("site_peak_rss_mb"),
        "failures": summary["totals"]["failures"],
        "curve": accuracy,
        "uplink_curve": uplink,
        "downlink_curve": downlink,
    }


def round_swing(curve: list[float]) -> float | None:
    """Mean absolute change of the global accuracy from one round to the next, over the
    rounds before the last (the last adds the head calibration): how far the model a site
    publishes each round jumps. A curve of 10 points a round up and down reaches a target
    on the round the swing allows, not only the one learning does (docs/benchmarks/plant.md)."""
    trained = curve[:-1]
    if len(trained) < 2:
        return None
    return statistics.fmean(abs(b - a) for a, b in zip(trained, trained[1:]))


def new_class_precision(config: RunConfig, folder: Path) -> float | None:
    """The final model's :func:`precision_from` for the new class(es) on the last phase's
    global test set (None: one phase, or never diagnosed). Recall alone can be bought by
    calling old faults new: at alpha 0.1 the built-ins' recall of 35–69 % came with 18–37 %
    precision (docs/benchmarks/plant.md)."""
    if config.phases < 2 or config.drift_new_classes < 1:
        return None
    model = load_model(folder).model
    test = phase_test_set(config.drift_spec(), config.data_root, config.phases - 1)
    confusion = evaluate(model, known(test, model.head.out_features), torch.device("cpu")).confusion
    return precision_from(confusion, model.head.out_features - config.drift_new_classes)


def precision_from(confusion: np.ndarray, first: int) -> float | None:
    """Of the diagnoses of classes ``first..`` (``confusion``: rows the true class, columns
    the diagnosis), the share whose true class is one of them; None if none was made."""
    called = int(confusion[:, first:].sum())
    return int(confusion[first:, first:].sum()) / called if called else None


def target_for(per_run: dict[tuple[str, float], list[dict]], alpha: float, default: float) -> float:
    """The accuracy target at ``alpha``: ``TARGET_SHARE`` of FedAvg's mean final accuracy
    there (the same bar for every variant, set by the baseline alone), else ``default``
    (``--target``: the target of an earlier run with FedAvg, for a run without it)."""
    runs = per_run.get(("FedAvg", alpha))
    return TARGET_SHARE * statistics.fmean(r["final_accuracy"] for r in runs) if runs else default


def parse_targets(pairs: list[str]) -> dict[float, float]:
    """``["0.3=0.459", ...]`` as ``{alpha: accuracy target}``."""
    targets = {}
    for pair in pairs:
        alpha, _, target = pair.partition("=")  # no "=": target "" fails float() below
        try:
            alpha_value, target_value = float(alpha), float(target)
        except ValueError:
            raise SystemExit(f"--target: expected ALPHA=ACCURACY (e.g. 0.3=0.459), got {pair!r}") from None
        if not 0 < target_value <= 1:
            raise SystemExit(f"--target: expected ALPHA=ACCURACY with 0 < ACCURACY <= 1, got {pair!r}")
        targets[alpha_value] = target_value
    return targets


def with_target(run: dict, target: float) -> dict:
    """``run`` plus rounds to ``target`` and the uplink and total traffic until then."""
    reached = next((i + 1 for i, a in enumerate(run["curve"]) if a >= target), None)
    return {
        **run,
        "rounds_to_target": reached,
        "uplink_mb_to_target": sum(run["uplink_curve"][:reached]) / 1e6 if reached else None,
        "traffic_mb": (sum(run["uplink_curve"]) + sum(run["downlink_curve"])) / 1e6,
    }


def _csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


METRICS = (  # key, header, format, better ("max" / "min")
    ("final_accuracy", "final acc %", "pct", "max"),
    ("worst_line", "worst line %", "pct", "max"),
    ("rounds_to_target", "rounds to target", "int", "min"),
    ("uplink_mb_to_target", "uplink MB to target", "mb", "min"),
    ("uplink_mb", "uplink MB", "mb", "min"),
    ("downlink_mb", "downlink MB", "mb", "min"),
    ("traffic_mb", "up + down MB", "mb", "min"),
    ("forgetting", "forgetting phase 0 (pp)", "pct", "min"),
    ("new_class_recall", "new-class recall %", "pct", "max"),
    ("new_class_precision", "new-class precision %", "pct", "max"),
    ("swing", "round-to-round change (pp)", "pct", "min"),
    ("site_cpu_seconds", "site CPU s", "int", "min"),
    ("site_peak_mb", "agent peak MiB", "int", "min"),  # loopback runtime: all sites share one process
)


def summarise(runs: list[dict]) -> dict:
    out = {}
    for key, *_ in METRICS:
        values = [r[key] for r in runs]
        finite = [v for v in values if v is not None and math.isfinite(v)]
        out[key] = {
            "mean": statistics.fmean(finite) if finite else None,
            "std": statistics.stdev(finite) if len(finite) > 1 else 0.0,
            "missing": len(values) - len(finite),  # e.g. target never reached
        }
    out["seeds"] = [r["seed"] for r in runs]
    return out


def _cell(stat: dict, kind: str) -> str:
    if stat["mean"] is None:
        return "–"
    mean, std = stat["mean"], stat["std"]
    text = {
        "pct": f"{100 * mean:.1f} ± {100 * std:.1f}",
        "int": f"{mean:.0f} ± {std:.0f}",
        "mb": f"{mean:.2f} ± {std:.2f}" if mean >= 0.1 else f"{1000 * mean:.0f} kB ± {1000 * std:.0f}",
    }[kind]
    return text + (f" ({stat['missing']} n/r)" if stat["missing"] else "")


def table(results: dict[str, dict[str, dict]], alphas, seeds, base: RunConfig, targets: dict[float, float]) -> str:
    lines = [
        f"Plant scenario: {base.num_sites} lines, {base.phases} phases x {base.phase_rounds} rounds "
        f"({base.num_server_rounds} in all), {base.drift_regime_share:.0%} of the lines drift to "
        f"{base.drift_speed_factor:g}x speed at phase 1, {base.drift_new_classes} new class at one line, line "
        f"{ABSENT_SITE} off the network in rounds {ABSENT_ROUNDS.start}-{ABSENT_ROUNDS.stop - 1}; target: "
        f"{TARGET_SHARE:.0%} of FedAvg's mean final accuracy at that alpha; seeds {', '.join(map(str, seeds))}; "
        "mean ± std over seeds (n/r: seeds where the target was not reached).",
    ]
    for alpha in alphas:
        lines += ["", f"### Dirichlet alpha {alpha:g} (target {targets[alpha]:.3f})", "",
                  "| variant | " + " | ".join(h for _, h, _, _ in METRICS) + " |",
                  "|---|" + "---|" * len(METRICS)]
        for name, by_alpha in results.items():
            if f"{alpha:g}" in by_alpha:
                stats = by_alpha[f"{alpha:g}"]
                label = name if stats["seeds"] == list(seeds) else f"{name} (seeds {', '.join(map(str, stats['seeds']))})"
                lines.append(f"| {label} | " + " | ".join(_cell(stats[k], kind) for k, _, kind, _ in METRICS) + " |")
    return "\n".join(lines)


def plot(per_run: dict[tuple[str, float], list[dict]], alphas, base: RunConfig, path: Path) -> None:
    with saved_figure(path, 1, len(alphas), figsize=(7 * len(alphas), 4.5), squeeze=False) as (fig, axes):
        for ax, alpha in zip(axes[0], alphas):
            for (name, a), runs in per_run.items():
                if a != alpha or not runs or not (name in BUILTINS or name == "recipe"):
                    continue
                curve = [statistics.fmean(v) for v in zip(*(r["curve"] for r in runs))]
                ax.plot(range(1, len(curve) + 1), curve, label=name, linewidth=2.5 if name == "recipe" else 1.2)
            for end in base.phase_end_rounds():
                ax.axvline(end, color="grey", linestyle=":")
            ax.axvspan(ABSENT_ROUNDS.start, ABSENT_ROUNDS.stop - 1, color="orange", alpha=0.1, label="a line is off")
            ax.set(xlabel="round", ylabel="global test accuracy (mean over seeds)", title=f"alpha {alpha:g}", ylim=(0, 1))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.1, 0.3])
    parser.add_argument("--seeds", type=int, nargs="+", default=[5, 6, 7, 8, 9])
    parser.add_argument("--out", default="runs/plant")
    parser.add_argument("--family", choices=("bearing", "gearbox"), default="bearing",
                        help="data family: fedind's bearing generator, or the gearbox one (fedind.data.gearbox)")
    parser.add_argument("--runtime", default="ray", help="fedind.simulation runtime (ray, or loopback where available)")
    parser.add_argument("--report-only", action="store_true",
                        help="report the finished runs among those asked for; start none (rows name their seeds)")
    parser.add_argument("--target", action="append", default=[], metavar="ALPHA=ACC",
                        help="accuracy target at ALPHA where FedAvg is not among the variants, once per "
                             "alpha (e.g. --target 0.3=0.459: 90 %% of FedAvg's mean final accuracy on seeds 5-9)")
    args, overrides = parser.parse_known_args(argv)
    given_targets = parse_targets(args.target)
    base = parse_overrides(overrides, {**pyproject_run_config(), **SCENARIO})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(
        {"base": base.to_flower(), "variants": {n: VARIANTS[n] for n in args.variants}, "alphas": args.alphas,
         "seeds": args.seeds, "absent_site": ABSENT_SITE, "absent_rounds": list(ABSENT_ROUNDS)}, indent=2))
    configs = {(n, a, s): variant_config(base, n, a, s, out) for s in args.seeds for a in args.alphas for n in args.variants}
    if args.family == "gearbox":
        configs = {key: replace(c, data_root=gearbox_root(out, base, key[1], key[2])) for key, c in configs.items()}
    if args.report_only:
        configs = {key: c for key, c in configs.items() if finished(c)}
    pending = [c for c in configs.values() if not finished(c)]
    if pending:
        kwargs = {"runtime": args.runtime} if args.runtime != "ray" else {}
        simulate_many(pending, client_app=site_app(outer_mods=(absent_mod,)), **kwargs)
    per_run: dict[tuple[str, float], list[dict]] = {}
    for (name, alpha, seed), config in configs.items():
        per_run.setdefault((name, alpha), []).append({"seed": seed, **measure(config)})
    targets = {alpha: target_for(per_run, alpha, given_targets.get(alpha, base.target_accuracy)) for alpha in args.alphas}
    per_run = {(n, a): [with_target(r, targets[a]) for r in runs] for (n, a), runs in per_run.items()}
    results: dict[str, dict[str, dict]] = {}
    for (name, alpha), runs in per_run.items():
        results.setdefault(name, {})[f"{alpha:g}"] = summarise(runs)
    text = table(results, args.alphas, args.seeds, base, targets)
    (out / "table.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(
        {"summary": results, "targets": {f"{a:g}": t for a, t in targets.items()},
         "runs": {f"{n} a{a:g}": runs for (n, a), runs in per_run.items()}}, indent=2))
    plot(per_run, args.alphas, base, out / "plant.png")
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
