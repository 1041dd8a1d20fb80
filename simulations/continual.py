"""Continual-learning benchmark: fine-tuning vs replay vs EWC vs both, on a two-phase plant.

Same federation, drift scenario, model, strategy, seeds and budget for every variant
(pyproject defaults, this script's scenario defaults ``phases=2 phase-rounds=30
num-server-rounds=60 drift-regime-share=1.0``, then any ``key=value`` overrides); only
replay and EWC differ:

- ``finetune``: the sites train on their newest batch only (FedAvg(M) fine-tuning);
- ``replay``: plus a bounded replay buffer (``replay-samples`` = --replay-samples, the
  ``replay-share`` bound of the base config, ``replay-ratio``, ``replay-policy``);
- ``ewc``: plus the federated EWC penalty (``ewc-lambda`` = --ewc-lambda);
- ``replay+ewc``: both;
- ``replay+ewc+server`` (not run by default): both, and the server damps each aggregate's
  drift from the EWC anchors by ``1 / (1 + kappa F)`` (``ewc-server-lambda`` = kappa =
  --ewc-server-lambda).

Phase 0: no line has the held-out fault class; phase 1: ``drift-regime-share`` of the lines
(here all) run under a new regime at ``drift-speed-factor`` times the shaft speed, every
line's fault mix is redrawn, one line sees the new class (fedind/data/drift.py). Reported per variant: accuracy on each phase's global test set at
the end of every phase, final average accuracy, forgetting (best earlier accuracy on a
phase's test set minus the final one, averaged over earlier phases), accuracy on the new
class, replay memory (windows, bytes, largest share of a site's windows) and the EWC bytes
added to each train message. The bar (issue 5): replay+ewc forgets at most 40 % of what
finetune forgets, its newest-phase accuracy within 2 points of finetune's, replay at most
10 % of a site's data, the new class recognised.

    python simulations/continual.py                       # 4 variants, seed 0
    python simulations/continual.py drift-regime-share=0.5 --variants finetune --seeds 0 1

(``key=value`` overrides first.) Writes OUT/{results.json,table.md,config.json,continual.png};
each run's folder is OUT/runs/<variant>-seed<N>, finished runs are reused.
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

from simulations.common import parse_overrides, pyproject_run_config, saved_figure  # noqa: E402

from fedind.simulation import simulate  # noqa: E402

# Every line moves to a new product speed at phase 1 (with half the lines on their old
# regime, fine-tuning forgot nothing: phase 0's accuracy rose by 4-6 points; see README).
SCENARIO = {"phases": 2, "phase-rounds": 30, "num-server-rounds": 60, "drift-regime-share": 1.0}
VARIANTS = ("finetune", "replay", "ewc", "replay+ewc")  # the four, run by default
EXTRA_VARIANTS = ("replay+ewc+server",)


def variant_config(base, name: str, replay_samples: int, ewc_lambda: float, ewc_server_lambda: float = 0.0):
    replay = replay_samples if "replay" in name else 0
    ewc = ewc_lambda if "ewc" in name else 0.0
    server = ewc_server_lambda if name.endswith("+server") else 0.0
    return replace(base, replay_samples=replay, ewc_lambda=ewc, ewc_server_lambda=server, head_calibration=False)  # as dated


def measure(config, name: str, out: Path) -> dict:
    folder = out / "runs" / name
    if not (folder / "summary.json").exists():
        simulate(replace(config, run_dir=str(out / "runs"), run_name=name))
    summary = json.loads((folder / "summary.json").read_text())
    with open(folder / "phases.csv", newline="") as f:
        phases = list(csv.DictReader(f))
    with open(folder / "rounds.csv", newline="") as f:
        rounds = list(csv.DictReader(f))
    c = summary["continual"]
    return {
        "accuracy_after_phase": c["accuracy_after_phase"],
        "final_per_phase": c["final_accuracy_per_phase"],
        "average_accuracy": c["average_accuracy"],
        "forgetting": c["forgetting"],
        "new_class_accuracy": c["new_class_accuracy"],
        "expansions": c["expansions"],
        "replay_max_samples": c["replay"]["max_samples"],
        "replay_max_bytes": c["replay"]["max_bytes"],
        "replay_max_share": c["replay"]["max_share"],
        "ewc_bytes_per_train_message": c["ewc_bytes_per_train_message"],
        "downlink_bytes_per_round": summary["totals"]["downlink_bytes"] / summary["rounds"],
        "uplink_bytes_per_round": summary["totals"]["uplink_bytes"] / summary["rounds"],
        "site_train_cpu_seconds": summary["totals"]["site_train_cpu_seconds"],
        "seconds": summary["totals"]["seconds"],
        "curves": {
            key: [float(r[key]) if r[key] else float("nan") for r in phases]
            for key in phases[0]
            if key.startswith("accuracy_phase_") or key == "new_class_accuracy"
        },
        "rounds": [int(r["round"]) for r in phases],
        "uplink_curve": [int(r["uplink_bytes"]) for r in rounds],
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS + EXTRA_VARIANTS)
    parser.add_argument("--replay-samples", type=int, default=256, help="cap; replay-share usually binds")
    parser.add_argument("--ewc-lambda", type=float, default=10.0)
    parser.add_argument("--ewc-server-lambda", type=float, default=10.0, help="kappa of replay+ewc+server")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--out", default="runs/continual")
    args, overrides = parser.parse_known_args(argv)
    base = parse_overrides(overrides, {**pyproject_run_config(), **SCENARIO})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    per_run: dict[str, list[dict]] = {name: [] for name in args.variants}
    for seed in args.seeds:
        for name in args.variants:
            config = variant_config(
                replace(base, seed=seed), name, args.replay_samples, args.ewc_lambda, args.ewc_server_lambda
            )
            figures = measure(config, f"{name}-seed{seed}", out)
            per_run[name].append({"seed": seed, **figures})
            print(
                f"{name} seed {seed}: average {figures['average_accuracy']:.4f} forgetting "
                f"{figures['forgetting']:.4f} new class {figures['new_class_accuracy']}",
                flush=True,
            )
    results = {name: _summarise(runs) for name, runs in per_run.items()}
    table = _table(results, base, args) + _per_seed(per_run)
    (out / "table.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps({"summary": results, "runs": per_run}, indent=2))
    (out / "config.json").write_text(
        json.dumps(
            {"base": base.to_flower(), "variants": args.variants, "replay_samples": args.replay_samples,
             "ewc_lambda": args.ewc_lambda, "ewc_server_lambda": args.ewc_server_lambda, "seeds": args.seeds},
            indent=2,
        )
    )
    _plot(per_run, base, out / "continual.png")
    print(table)


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _summarise(runs: list[dict]) -> dict:
    phases = len(runs[0]["final_per_phase"])
    return {
        "after_own_phase": [_mean(r["accuracy_after_phase"][q][q] for r in runs) for q in range(phases)],
        "final_per_phase": [_mean(r["final_per_phase"][q] for r in runs) for q in range(phases)],
        "average_accuracy": _mean(r["average_accuracy"] for r in runs),
        "forgetting": _mean(r["forgetting"] for r in runs),
        "new_class_accuracy": _mean(r["new_class_accuracy"] for r in runs),
        # one line's 60 test windows of one class: the final round alone is noisy
        "new_class_last5": _mean(_nanmean(r["curves"]["new_class_accuracy"][-5:]) for r in runs),
        "replay_max_samples": max(r["replay_max_samples"] for r in runs),
        "replay_max_bytes": max(r["replay_max_bytes"] for r in runs),
        "replay_max_share": max((r["replay_max_share"] or 0.0) for r in runs),
        "ewc_bytes_per_train_message": max(r["ewc_bytes_per_train_message"] for r in runs),
        "downlink_bytes_per_round": _mean(r["downlink_bytes_per_round"] for r in runs),
        "seconds": _mean(r["seconds"] for r in runs),
    }


def _nanmean(values: list[float]) -> float | None:
    values = [v for v in values if v == v]
    return statistics.fmean(values) if values else None


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def _table(results: dict[str, dict], base, args) -> str:
    phases = base.phases
    lines = [
        f"{base.strategy}, {base.num_sites} sites, Dirichlet alpha {base.dirichlet_alpha}, {phases} phases x "
        f"{base.phase_rounds} rounds ({base.num_server_rounds} in all), {base.local_epochs} local epochs; drift: "
        f"{base.drift_regime_share:.0%} of the lines move to a new regime at {base.drift_speed_factor:g}x shaft speed, "
        f"{base.drift_new_classes} new class at one line; "
        f"replay cap {args.replay_samples} windows, share {base.replay_share:g}, ratio {base.replay_ratio:g}, "
        f"policy {base.replay_policy}; EWC lambda {args.ewc_lambda:g}, gamma {base.ewc_gamma:g}"
        + (f", server damping kappa {args.ewc_server_lambda:g}; " if any(n in results for n in EXTRA_VARIANTS) else "; ")
        + f"seeds {', '.join(map(str, args.seeds))}. Accuracies in %.",
        "",
        "| variant | "
        + " | ".join(f"phase {q} after phase {q}" for q in range(phases))
        + " | "
        + " | ".join(f"phase {q} final" for q in range(phases))
        + " | average | forgetting (pp) | vs finetune | new class (last round / last 5) | replay windows (max) "
        "| replay share (max) "
        "| replay bytes (max) | EWC bytes / train msg | downlink / round |",
        "|---|" + "---|" * (2 * phases + 10),
    ]
    ft = results.get("finetune", {}).get("forgetting")
    for name, r in results.items():
        ratio = "–" if not ft or r["forgetting"] is None else f"{r['forgetting'] / ft:.2f}×"
        lines.append(
            f"| {name} | "
            + " | ".join(_pct(a) for a in r["after_own_phase"])
            + " | "
            + " | ".join(_pct(a) for a in r["final_per_phase"])
            + f" | {_pct(r['average_accuracy'])} | {_pct(r['forgetting'])} | {ratio} "
            f"| {_pct(r['new_class_accuracy'])} / {_pct(r['new_class_last5'])} "
            f"| {r['replay_max_samples']} | {_pct(r['replay_max_share'])} % | {r['replay_max_bytes'] / 1e3:,.1f} kB "
            f"| {r['ewc_bytes_per_train_message'] / 1e3:,.1f} kB | {r['downlink_bytes_per_round'] / 1e3:,.0f} kB |"
        )
    both, fine = results.get("replay+ewc"), results.get("finetune")
    if both and fine and both["forgetting"] is not None and fine["forgetting"]:
        newest = (both["final_per_phase"][-1] - fine["final_per_phase"][-1]) * 100
        lines += [
            "",
            f"Bar: replay+ewc forgetting {_pct(both['forgetting'])} pp = {both['forgetting'] / fine['forgetting']:.2f}× "
            f"finetune's {_pct(fine['forgetting'])} pp (needs <= 0.40×: "
            f"{'met' if both['forgetting'] <= 0.4 * fine['forgetting'] else 'NOT met'}); newest phase "
            f"{newest:+.1f} pp vs finetune (needs >= -2: {'met' if newest >= -2 else 'NOT met'}); replay share "
            f"{_pct(both['replay_max_share'])} % (needs <= 10: {'met' if both['replay_max_share'] <= 0.1 else 'NOT met'}); "
            f"new class {_pct(both['new_class_accuracy'])} %.",
        ]
    return "\n".join(lines)


def _per_seed(per_run: dict[str, list[dict]]) -> str:
    """The bar, seed by seed (replay+ewc against finetune of the same seed)."""
    if "finetune" not in per_run or "replay+ewc" not in per_run:
        return ""
    lines = ["", "| seed | finetune forgetting | replay+ewc forgetting | ratio | newest phase, replay+ewc − finetune |",
             "|---|---|---|---|---|"]
    for fine, both in zip(per_run["finetune"], per_run["replay+ewc"]):
        ratio = f"{both['forgetting'] / fine['forgetting']:.2f}×" if fine["forgetting"] else "–"
        newest = 100 * (both["final_per_phase"][-1] - fine["final_per_phase"][-1])
        lines.append(
            f"| {fine['seed']} | {_pct(fine['forgetting'])} pp | {_pct(both['forgetting'])} pp | {ratio} | {newest:+.1f} pp |"
        )
    return "\n".join(lines)


def _plot(per_run: dict[str, list[dict]], base, path: Path) -> None:
    keys = [f"accuracy_phase_{q}" for q in range(base.phases)] + ["new_class_accuracy"]
    with saved_figure(path, 1, len(keys), figsize=(5 * len(keys), 4), sharey=True) as (fig, axes):
        for ax, key in zip(axes, keys):
            for name, runs in per_run.items():
                curve = [statistics.fmean(v) for v in zip(*(r["curves"][key] for r in runs))]
                ax.plot(runs[0]["rounds"], curve, label=name)
            for end in range(1, base.phases):
                ax.axvline(end * base.phase_rounds, color="grey", linestyle=":")
            title = "new class (global test, last phase)" if key == "new_class_accuracy" else key.replace("accuracy_", "test set of ")
            ax.set(xlabel="round", title=title, ylim=(0, 1))
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("accuracy (mean over seeds)")
        axes[0].legend()


if __name__ == "__main__":
    main(sys.argv[1:])
