r"""Poisoning benchmark: one site in ten sends scaled or sign-flipped updates.

The attacked site (``--sites``, partition 0 by default: one of the default scenario's ten)
trains honestly, then replaces its trained weights ``w`` by

    scale λ:     g + λ (w − g)      (boosting: its update counts λ times)
    signflip λ:  g − λ (w − g)      (its update, reversed and scaled)
    bodyflip λ:  as signflip, except the classifier bias ``head.bias``, sent honest (an
                 attacker who knows the server's label-alignment rule)

with ``g`` the global weights it received; ``absent`` sends an error reply instead (the
site's data lost to the federation: what any defence that rejects the attacker every
round ends with, the floor such a defence cannot beat). Its ``num-examples`` and label
histogram stay honest, so only the weights are poisoned and the structural screen has
nothing to catch;
the server's norm rule (``fedind/server/screening.py``) sees the update norm, λ times the honest
one, and its label-alignment rule the classifier-bias update, reversed by ``signflip``
(and left honest by ``bodyflip``). Every strategy runs behind that screen, as the server
always does for plaintext updates; Flower's robust aggregators then see what passed it.

Variants: each strategy (``--strategies``) clean and under each attack (``--attacks``),
same seeds and data. Reports final and best global accuracy, the drop vs the same
strategy's clean run and vs the default strategy's (fedavgm) clean run, and the replies
the server rejected (``failures`` summed over rounds.csv).

    python simulations/poisoning.py                                             # everything (25 runs per seed)
    python simulations/poisoning.py --strategies fedavgm --attacks scale10 signflip4
    python simulations/poisoning.py num-server-rounds=4 --out /tmp/poisoning-smoke   # smoke

(``key=value`` overrides first: ``--seeds``, ``--strategies``, ``--attacks`` and ``--sites``
take every value after them; ``--no-run`` tabulates the finished runs of that grid only.)
Attacks are ``scale<λ>``, ``signflip<λ>``, ``bodyflip<λ>`` or ``absent``; the defaults are ``scale10``
(stealthy: at the screen's 10x floor, it passes whenever the site's honest norm is at or
below the round's median, and is scaled down to the bound above it), ``scale100``
(obvious: rejected beyond 50x the median, so in every round where the site's honest
update is at least half the median), ``signflip1`` (a plain reversed update of ordinary
norm: never rejected by the norm rule) and ``signflip4`` (reversed and boosted: passes under 10x the
median, scaled down between 10x and 50x; the label-alignment rule reads the direction,
not the norm, so to it signflip4 looks as signflip1 does). In the table, "rejected" counts every failed
reply, so an ``absent`` site's 80 error replies are in it. ``--clip-ratio c`` runs the
server's screen with its norm clip at ``c`` times the round's median
(``fedind.server.screening``; off by default).

Writes OUT/{results.json,table.md,poisoning.png}; each run's folder is
OUT/runs/<strategy>-<attack>-seed<N> (with ``norms.csv``: every reply's update norm, its
ratio to the round's median, its cosine to the round's median update, its label alignment,
rejected or not), and
finished runs are reused, so an interrupted benchmark picks up where it stopped (and runs
added later join the table).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from unittest import mock

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Error, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulations.common import parse_overrides, saved_figure  # noqa: E402

import fedind.server.app  # noqa: E402
from fedind import wire  # noqa: E402
from fedind.site.app import site_app  # noqa: E402
from fedind.server.screening import UpdateScreen, label_alignment  # noqa: E402
from fedind.simulation import simulate  # noqa: E402

KINDS = ("scale", "signflip", "bodyflip", "absent")
ABSENT_CODE = wire.SITE_ABSENT  # Error code of the absent site's train reply
HONEST_IN_BODYFLIP = "head.bias"  # the array a bodyflip attacker leaves as trained: what the alignment rule reads
DEFAULT_STRATEGY = "fedavgm"
CLEAN = "clean"


# --------------------------------------------------------------------------- the attack


@dataclass(frozen=True)
class Attack:
    """``kind`` in :data:`KINDS`, ``strength`` λ > 0 (1 for ``absent``)."""

    kind: str
    strength: float

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Invalid attack kind: {self.kind!r} (choose from {', '.join(KINDS)})")
        if not (np.isfinite(self.strength) and self.strength > 0):
            raise ValueError(f"Invalid attack strength: {self.strength!r}")
        if self.kind == "absent" and self.strength != 1.0:
            raise ValueError(f"Invalid attack strength: {self.strength!r} (absent takes none)")

    @property
    def name(self) -> str:
        return "absent" if self.kind == "absent" else f"{self.kind}{self.strength:g}"

    @classmethod
    def parse(cls, text: str) -> "Attack":
        """``scale10``, ``signflip4``, ``scale2.5``, ``absent``."""
        if text == "absent":
            return cls("absent", 1.0)
        match = re.fullmatch(r"(scale|signflip|bodyflip)([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)", text)
        if match is None:
            raise ValueError(
                f"Invalid attack {text!r}: expected scale<λ>, signflip<λ>, bodyflip<λ> or absent, e.g. scale10"
            )
        return cls(match.group(1), float(match.group(2)))


def poison(
    sent: Mapping[str, np.ndarray], trained: Mapping[str, np.ndarray], attack: Attack
) -> dict[str, np.ndarray]:
    r"""The attacker's weights: :math:`g + \lambda (w - g)` (scale) or
    :math:`g - \lambda (w - g)` (signflip; bodyflip except ``head.bias``, sent as
    trained), per array, in float64 and cast back to each array's dtype. ``sent``: the
    global weights ``g``; ``trained``: the honest ``w``. Non-float arrays pass unchanged.
    (``absent`` has no weights: :class:`PoisonMod`.)"""
    if attack.kind == "absent":
        raise ValueError("the absent attack sends no weights")
    if set(sent) != set(trained):
        raise ValueError(f"arrays differ: {sorted(set(sent) ^ set(trained))}")
    sign = 1.0 if attack.kind == "scale" else -1.0
    out = {}
    for name, w in trained.items():
        if not np.issubdtype(w.dtype, np.floating) or (attack.kind == "bodyflip" and name == HONEST_IN_BODYFLIP):
            out[name] = w
            continue
        g = np.asarray(sent[name], dtype=np.float64)
        out[name] = (g + sign * attack.strength * (w.astype(np.float64) - g)).astype(w.dtype)
    return out


@dataclass(frozen=True)
class PoisonMod:
    """Flower client mod (innermost, so it sees the dense trained weights): at the sites
    whose ``partition-id`` is in ``sites``, the train reply's weights become
    :func:`poison` of them (with ``absent``, an error reply); everything else in the reply
    (``num-examples``, label histogram, metrics) stays honest. Other sites and other
    messages pass unchanged."""

    attack: Attack
    sites: tuple[int, ...] = (0,)

    def __call__(self, msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
        reply = call_next(msg, context)
        if msg.metadata.message_type != MessageType.TRAIN or reply.has_error():
            return reply
        if int(context.node_config.get("partition-id", -1)) not in self.sites:
            return reply
        if self.attack.kind == "absent":
            return Message(Error(code=ABSENT_CODE, reason="poisoning benchmark: this site is absent"), reply_to=msg)
        sent, trained = msg.content[wire.ARRAYS], reply.content[wire.ARRAYS]
        poisoned = poison(
            {k: sent[k].numpy() for k in sent}, {k: trained[k].numpy() for k in trained}, self.attack
        )
        record = ArrayRecord({name: Array(poisoned[name]) for name in trained})
        content = RecordDict({name: (record if name == wire.ARRAYS else r) for name, r in reply.content.items()})
        return Message(content, reply_to=msg)


def attacked_app(attack: Attack, sites: tuple[int, ...]) -> ClientApp:
    """fedind's site agent (same handlers and mods) with :class:`PoisonMod` innermost."""
    return site_app(PoisonMod(attack, sites))


# --------------------------------------------------------------------------- the benchmark


def peer_cosines(deltas: Sequence[np.ndarray], histograms: Sequence[Sequence[float]]) -> np.ndarray:
    r"""Per site, the cosine of its update to the updates of the sites that hold the same
    classes: with :math:`p_i` the label distribution of site :math:`i` and
    :math:`\mathrm{sim}_{ij}` the cosine of :math:`p_i` and :math:`p_j`,

    .. math::  c_i = \cos\Big(d_i,\; \sum_{j \ne i} \mathrm{sim}_{ij}\, d_j / \lVert d_j \rVert\Big)

    Each peer's update is normalised, so one long update does not set the reference. Sites
    that share classes train the same head rows towards the same features, so an honest
    site points with its label peers even where it points away from the round's overall
    median (which mixes every class); a reversed update points against them. NaN where
    a site has no peer (no class in common, or a zero update).

    A diagnostic of the benchmark, not a rule of the server: in the sign-flip run of seed 2
    it did not separate the attacker (mean -0.11 over 80 rounds) from honest lines (-0.27
    to +0.11), because label peers also hold the attacker's classes and Non-IID machines
    move the features differently (README, *Poisoning*)."""
    d = [np.asarray(x, dtype=np.float64).ravel() for x in deltas]
    h = np.asarray(histograms, dtype=np.float64)
    if len(d) != len(h) or h.ndim != 2 or np.any(h < 0) or not np.all(np.isfinite(h)):
        raise ValueError("Invalid deltas/histograms: one non-negative histogram per delta, of equal length")
    units = np.stack(d)
    lengths = np.linalg.norm(units, axis=1)
    units /= np.where(lengths > 0, lengths, 1.0)[:, None]
    hist_norms = np.linalg.norm(h, axis=1, keepdims=True)
    p = h / np.where(hist_norms > 0, hist_norms, 1.0)
    sim = p @ p.T
    np.fill_diagonal(sim, 0.0)  # a site is not its own peer
    references = sim @ units
    norms = np.linalg.norm(references, axis=1)
    out = np.full(len(d), np.nan)
    ok = (norms > 0) & (lengths > 0)
    out[ok] = np.einsum("ij,ij->i", units[ok], references[ok]) / norms[ok]
    return out


def recording_screen(rows: list[dict], clip_ratio: float | None = None) -> type[UpdateScreen]:
    """The server's :class:`UpdateScreen`, also appending to ``rows`` every train reply's
    update norm, its ratio to the round's median norm, its cosine to the coordinate-wise
    median update of the round and whether the screen rejected it. ``clip_ratio``: when
    set, the screen's norm clip at that ratio (else the server's default)."""

    class RecordingScreen(UpdateScreen):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **({"clip_ratio": clip_ratio} | kwargs if clip_ratio is not None else kwargs))

        def rules(self, updates: list) -> dict:
            verdicts = super().rules(updates)
            alignments = {}  # node -> this round's label alignment (fedind.server.screening.label_alignment)
            norms, labelled = {}, {}  # node -> (site, update); node -> (update, head update, histogram)
            for update in updates:  # the round's typed updates (fedind.server.pipeline), before the rules
                if not update.has_update:
                    continue
                delta, histogram = update.delta, update.histogram
                flat = np.concatenate([d.ravel() for d in delta.values()])
                norms[update.node_id] = (update.site_id, flat)
                if histogram is not None:
                    head = np.concatenate([d.ravel() for k, d in sorted(delta.items()) if k.startswith("head.")])
                    labelled[update.node_id] = (flat, head, list(histogram))
                    alignments[update.node_id] = label_alignment(delta["head.bias"], histogram)
            peers = peers_head = {}
            if len(labelled) >= 2:
                histograms = [h for _, _, h in labelled.values()]
                peers = dict(zip(labelled, peer_cosines([f for f, _, _ in labelled.values()], histograms)))
                peers_head = dict(zip(labelled, peer_cosines([h for _, h, _ in labelled.values()], histograms)))
            if norms:
                server_round = 1 + max((r["round"] for r in rows), default=0)
                lengths = {node: float(np.linalg.norm(flat)) for node, (_, flat) in norms.items()}
                median = float(np.median(list(lengths.values())))
                middle = np.median(np.stack([flat for _, flat in norms.values()]), axis=0)
                rejected = {updates[i].node_id for i, v in verdicts.items() if isinstance(v, str)}
                for node, (site, flat) in sorted(norms.items(), key=lambda kv: kv[1][0]):
                    cosine = float(flat @ middle) / max(lengths[node] * float(np.linalg.norm(middle)), 1e-300)
                    rows.append({"round": server_round, "site": site, "norm": lengths[node],
                                 "ratio_to_median": lengths[node] / median, "cosine_to_median_update": cosine,
                                 "peer_cosine": peers.get(node, float("nan")),
                                 "peer_cosine_head": peers_head.get(node, float("nan")),
                                 "label_alignment": alignments.get(node, float("nan")),
                                 "rejected": node in rejected})
            return verdicts

    return RecordingScreen


def measure(
    config, attack: Attack | None, sites: tuple[int, ...], name: str, out: Path, clip_ratio: float | None = None
) -> dict:
    """One run's figures (running it unless its results exist); the run's folder also gets
    ``norms.csv``: every train reply's update norm, its ratio to the round's median and its
    cosine to the round's coordinate-wise median update (see :func:`recording_screen`)."""
    folder = out / "runs" / name
    if not (folder / "summary.json").exists():
        app = attacked_app(attack, sites) if attack is not None else None
        norms: list[dict] = []
        with mock.patch.object(fedind.server.app, "UpdateScreen", recording_screen(norms, clip_ratio)):
            simulate(replace(config, run_dir=str(out / "runs"), run_name=name), client_app=app)
        with open(folder / "norms.csv", "w", newline="") as f:
            fields = ["round", "site", "norm", "ratio_to_median", "cosine_to_median_update", "peer_cosine",
                      "peer_cosine_head", "label_alignment", "rejected"]
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(norms)
    summary = json.loads((folder / "summary.json").read_text())
    with open(folder / "rounds.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return {
        "final_accuracy": summary["final_accuracy"],
        "best_accuracy": summary["best_accuracy"],
        "best_round": summary["best_round"],
        "rejected": sum(int(r["failures"]) for r in rows),
        "rounds": len(rows),
        "seconds": summary["totals"]["seconds"],
        "curve": [float(r["accuracy"]) for r in rows],
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", nargs="+", default=["fedavg", "fedavgm", "fedmedian", "fedtrimmedavg", "krum"])
    parser.add_argument("--attacks", nargs="+", default=["scale10", "scale100", "signflip1", "signflip4"])
    parser.add_argument("--sites", type=int, nargs="+", default=[0], help="partition ids of the attacked sites")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--clip-ratio", type=float, default=None,
                        help="run the server's screen with this norm clip (fedind.server.screening; default: the server's)")
    parser.add_argument("--out", default="runs/poisoning")
    parser.add_argument("--no-run", action="store_true", help="tabulate the finished runs only, run nothing")
    args, overrides = parser.parse_known_args(argv)
    base = parse_overrides(overrides)
    attacks = {CLEAN: None} | {a.name: a for a in map(Attack.parse, args.attacks)}
    strategies = list(dict.fromkeys(args.strategies))
    sites = tuple(args.sites)
    if any(not 0 <= s < base.num_sites for s in sites):
        raise SystemExit(f"--sites {list(sites)}: partition ids are 0..{base.num_sites - 1}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    # The default strategy's clean run is every row's second reference.
    order = ([(DEFAULT_STRATEGY, CLEAN)] if DEFAULT_STRATEGY not in strategies else []) + [
        (s, a) for s in strategies for a in attacks
    ]
    if args.no_run:  # only the variants whose runs all exist, and only rows with both clean references
        done = {(s, a) for s, a in order if all(
            (out / "runs" / f"{s}-{a}-seed{seed}" / "summary.json").exists() for seed in args.seeds)}
        order = [(s, a) for s, a in order if {(s, a), (s, CLEAN), (DEFAULT_STRATEGY, CLEAN)} <= done]
        if not order:
            raise SystemExit(f"--no-run: no finished runs to tabulate in {out / 'runs'}")
    runs: dict[tuple[str, str], list[dict]] = {}
    for seed in args.seeds:
        for strategy, attack in order:
            name = f"{strategy}-{attack}-seed{seed}"
            config = replace(base, strategy=strategy, seed=seed)
            figures = measure(config, attacks[attack], sites, name, out, args.clip_ratio)
            runs.setdefault((strategy, attack), []).append({"seed": seed, **figures})
            print(f"{name}: final {figures['final_accuracy']:.4f}, rejected {figures['rejected']}", flush=True)

    results = [_summarise(s, a, r, runs) for (s, a), r in runs.items() if s in strategies]
    strategies = [s for s in strategies if any(r["strategy"] == s for r in results)]
    share = _attacked_share(base, sites)
    table = _table(results, base, args.seeds, sites, share, args.clip_ratio)
    (out / "table.md").write_text(table + "\n")
    (out / "results.json").write_text(
        json.dumps(
            {
                "base": base.to_flower(),
                "strategies": strategies,
                "attacks": list(attacks),
                "attacked_sites": list(sites),
                "attacked_share_of_examples": share,
                "clip_ratio": args.clip_ratio,
                "seeds": args.seeds,
                "results": [{k: v for k, v in r.items() if k != "curve"} for r in results],
                "runs": {f"{s}/{a}": r for (s, a), r in runs.items()},
            },
            indent=2,
        )
    )
    _plot(results, strategies, list(attacks), out / "poisoning.png")
    print(table)


def _summarise(strategy: str, attack: str, runs: list[dict], all_runs: dict) -> dict:
    """Means over seeds; drops are taken seed by seed against the clean references."""
    own, default = all_runs[(strategy, CLEAN)], all_runs[(DEFAULT_STRATEGY, CLEAN)]
    finals = [r["final_accuracy"] for r in runs]
    return {
        "strategy": strategy,
        "attack": attack,
        "final": statistics.fmean(finals),
        "final_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
        "best": statistics.fmean(r["best_accuracy"] for r in runs),
        "drop_vs_clean": statistics.fmean(c["final_accuracy"] - r["final_accuracy"] for r, c in zip(runs, own)),
        "drop_vs_default_clean": statistics.fmean(
            c["final_accuracy"] - r["final_accuracy"] for r, c in zip(runs, default)
        ),
        "rejected": [r["rejected"] for r in runs],
        "rounds": runs[0]["rounds"],
        "curve": [statistics.fmean(c) for c in zip(*(r["curve"] for r in runs))],
    }


def _attacked_share(config, sites: tuple[int, ...]) -> float | None:
    """Share of the federation's training windows held by the attacked sites (synthetic data)."""
    if config.data_root:
        return None
    from fedind.data.sources import site_from_partition

    sizes = [
        site_from_partition(config.federation_spec(), "", i, config.num_sites).train.num_examples
        for i in range(config.num_sites)
    ]
    return sum(sizes[i] for i in sites) / sum(sizes)


def _table(
    results: list[dict], base, seeds: list[int], sites: tuple[int, ...], share: float | None, clip: float | None
) -> str:
    held = f" ({100 * share:.1f} % of the training windows)" if share is not None else ""
    clipped = f" Screen with norm clip at {clip:g}x the round's median." if clip is not None else ""
    lines = [
        f"{base.num_server_rounds} rounds, {base.num_sites} sites, Dirichlet alpha {base.dirichlet_alpha}, "
        f"seeds {', '.join(map(str, seeds))}; attacked site(s) {', '.join(map(str, sites))}{held}, every round. "
        f"Drops in points of final accuracy (positive = worse); rejected = replies the server screened out, "
        f"summed over rounds (per seed).{clipped}",
        "",
        "| strategy | attack | final acc. | best acc. | drop vs own clean | drop vs fedavgm clean | rejected |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        std = f" ± {r['final_std']:.3f}" if len(seeds) > 1 else ""
        own = "–" if r["attack"] == CLEAN else f"{100 * r['drop_vs_clean']:+.1f}"
        lines.append(
            f"| {r['strategy']} | {r['attack']} | {r['final']:.3f}{std} | {r['best']:.3f} | {own} "
            f"| {100 * r['drop_vs_default_clean']:+.1f} | {', '.join(map(str, r['rejected']))} |"
        )
    return "\n".join(lines)


def _plot(results: list[dict], strategies: list[str], attacks: list[str], path: Path) -> None:
    with saved_figure(path, 1, 2, figsize=(13, 4.5)) as (fig, (ax_bar, ax_curve)):
        by_key = {(r["strategy"], r["attack"]): r for r in results}
        shown = [a for a in attacks if any((s, a) in by_key for s in strategies)]
        width = 0.8 / max(1, len(shown))
        for j, attack in enumerate(shown):
            xs = [i + (j - (len(shown) - 1) / 2) * width for i, s in enumerate(strategies) if (s, attack) in by_key]
            ys = [by_key[(s, attack)]["final"] for s in strategies if (s, attack) in by_key]
            ax_bar.bar(xs, ys, width, label=attack)
        reference = by_key.get((DEFAULT_STRATEGY, CLEAN))
        if reference is not None:
            ax_bar.axhline(reference["final"] - 0.02, color="black", linestyle="--", linewidth=1,
                           label=f"{DEFAULT_STRATEGY} clean − 2 points")
        ax_bar.set_xticks(range(len(strategies)), strategies)
        ax_bar.set(ylabel="final global test accuracy", ylim=(0, 1), title="final accuracy by strategy and attack")
        ax_bar.grid(alpha=0.3, axis="y")
        ax_bar.legend(fontsize=8)
        for attack in shown:
            r = by_key.get((DEFAULT_STRATEGY, attack))
            if r is not None:
                ax_curve.plot(range(1, len(r["curve"]) + 1), r["curve"], label=attack)
        ax_curve.set(xlabel="round", ylabel="global test accuracy", ylim=(0, 1), title=f"{DEFAULT_STRATEGY} per round")
        ax_curve.grid(alpha=0.3)
        ax_curve.legend(fontsize=8)


if __name__ == "__main__":
    main(sys.argv[1:])
