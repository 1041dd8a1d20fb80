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

The adaptive attacks of the robust-aggregation literature, all attacked sites sending the
same update (colluding) computed from every site's honest update of the round (the
strongest setting; :func:`collude`, applied where the server receives the round's replies,
before the screen): ``alie<z>`` (Baruch et al. 2019: mean − z·std, coordinate-wise),
``ipm<ε>`` (Xie et al. 2020: −ε·mean), ``minmax`` / ``minsum`` (Shejwalkar & Houmansadr
2021: mean − γ·std, γ the largest that keeps it within the honest updates' largest
distance / sum of squared distances). ``labelflip<c>``: the attacked lines train honestly
on data whose class ``c`` is labelled healthy (class 0): a targeted attack, or a plain
mislabelled line, judged by class ``c``'s recall (``--runtime loopback`` only: the data
are relabelled in this process). Every run's ``recall.json`` holds the final model's
per-class recall on the server's test set, and the table shows it for every row.

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
reply, so an ``absent`` site's 80 error replies are in it. The screen's norm clip is the run
config's ``norm-clip`` (``norm-clip=0`` runs without it).

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
import fedind.site.app  # noqa: E402
from fedind import wire  # noqa: E402
from fedind.site.app import site_app  # noqa: E402
from fedind.server.screening import UpdateScreen, consensus_cosines, label_alignment  # noqa: E402
from fedind.simulation import simulate  # noqa: E402
from fedind.topk.selection import topk_indices  # noqa: E402

KINDS = ("scale", "signflip", "bodyflip", "absent", "alie", "ipm", "minmax", "minsum", "labelflip")
# Attacks whose update is computed from the round's honest updates (colluding, omniscient):
# applied where the server receives the round's replies, before it screens them.
OMNISCIENT = ("alie", "ipm", "minmax", "minsum")
UNPARAMETRISED = ("absent", "minmax", "minsum")
ABSENT_CODE = wire.SITE_ABSENT  # Error code of the absent site's train reply
HONEST_IN_BODYFLIP = "head.bias"  # the array a bodyflip attacker leaves as trained: what the alignment rule reads
CLEAN = "clean"


# --------------------------------------------------------------------------- the attack


@dataclass(frozen=True)
class Attack:
    """``kind`` in :data:`KINDS`, ``strength`` λ > 0 (1 for ``absent``, ``minmax``, ``minsum``;
    z for ``alie``, ε for ``ipm``, the relabelled class for ``labelflip``)."""

    kind: str
    strength: float

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Invalid attack kind: {self.kind!r} (choose from {', '.join(KINDS)})")
        if not (np.isfinite(self.strength) and self.strength > 0):
            raise ValueError(f"Invalid attack strength: {self.strength!r}")
        if self.kind in UNPARAMETRISED and self.strength != 1.0:
            raise ValueError(f"Invalid attack strength: {self.strength!r} ({self.kind} takes none)")
        if self.kind == "labelflip" and self.strength != int(self.strength):
            raise ValueError(f"Invalid attack strength: {self.strength!r} (labelflip takes a class, >= 1)")

    @property
    def name(self) -> str:
        return self.kind if self.kind in UNPARAMETRISED else f"{self.kind}{self.strength:g}"

    @classmethod
    def parse(cls, text: str) -> "Attack":
        """``scale10``, ``signflip4``, ``scale2.5``, ``absent``, ``alie1``, ``ipm10``, ``minmax``,
        ``minsum``, ``labelflip3``."""
        if text in UNPARAMETRISED:
            return cls(text, 1.0)
        match = re.fullmatch(r"(scale|signflip|bodyflip|alie|ipm|labelflip)([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)", text)
        if match is None:
            raise ValueError(
                f"Invalid attack {text!r}: expected scale<λ>, signflip<λ>, bodyflip<λ>, alie<z>, ipm<ε>, "
                f"labelflip<class>, minmax, minsum or absent, e.g. scale10"
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
    if attack.kind not in ("scale", "signflip", "bodyflip"):
        raise ValueError(f"the {attack.kind} attack sends no weights computed from the site's own alone")
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
        if self.attack.kind in OMNISCIENT or self.attack.kind == "labelflip":
            return reply  # trained honestly (on relabelled data); replaced at the server (collude)
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


# --------------------------------------------------------------------------- colluding attacks


def within(update: np.ndarray, limit: int | None) -> np.ndarray:
    """``update`` with only its ``limit`` largest-magnitude values kept (all when ``None``):
    what a site can send when the server holds replies to the round's top-k budget
    (:class:`fedind.topk.uplink.RoundBudget`; the sites' own selection,
    :func:`fedind.topk.selection.topk_indices`)."""
    if limit is None or limit >= np.count_nonzero(update):
        return update
    kept = np.zeros_like(update)
    top = topk_indices(np.abs(update), limit)
    kept[top] = update[top]
    return kept


def colluding_update(honest: np.ndarray, attack: Attack, limit: int | None = None) -> np.ndarray:
    r"""The one update every colluding attacker sends, from the round's honest updates
    ``honest`` [n, D] (every site's, the attackers' own honest ones included: the
    strongest setting of the papers). With :math:`\mu`, :math:`\sigma` their coordinate-wise
    mean and standard deviation:

    - ``alie`` z (Baruch et al. 2019, "A little is enough"): :math:`\mu - z\sigma`;
    - ``ipm`` ε (Xie et al. 2020, inner-product manipulation): :math:`-\varepsilon\mu`;
    - ``minmax`` / ``minsum`` (Shejwalkar & Houmansadr 2021): :math:`\mu - \gamma\sigma` with
      the largest :math:`\gamma` (bisection) whose largest distance to an honest update
      (minmax), or whose sum of squared distances to them (minsum), is no more than the
      largest such figure of an honest update: it stays inside the honest spread.

    ``limit``: the most values the attackers may send (the round's top-k budget, less what
    the honest classifier bias takes); the update is cut to its ``limit`` largest values,
    and min-max / min-sum choose :math:`\gamma` for the cut update."""
    h = np.asarray(honest, dtype=np.float64)
    if h.ndim != 2 or len(h) < 2:
        raise ValueError("colluding attacks need at least two honest updates")
    mu, sigma = h.mean(axis=0), h.std(axis=0)
    if attack.kind == "alie":
        return within(mu - attack.strength * sigma, limit)
    if attack.kind == "ipm":
        return within(-attack.strength * mu, limit)
    if attack.kind not in ("minmax", "minsum"):
        raise ValueError(f"{attack.kind} is not a colluding attack")
    gram = h @ h.T
    sq = np.maximum(np.diag(gram)[:, None] + np.diag(gram)[None, :] - 2 * gram, 0.0)  # pairwise squared distances
    bound = sq.max() if attack.kind == "minmax" else sq.sum(axis=1).max()

    def inside(gamma: float) -> bool:
        m = within(mu - gamma * sigma, limit)
        d2 = np.maximum(np.sum(h * h, axis=1) - 2 * h @ m + m @ m, 0.0)
        return (d2.max() if attack.kind == "minmax" else d2.sum()) <= bound

    lo, hi = 0.0, 1.0
    while inside(hi) and hi < 1e6:
        lo, hi = hi, 2 * hi
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if inside(mid) else (lo, mid)
    return within(mu - lo * sigma, limit)


def collude(updates: list, attack: Attack, attackers: set[str]) -> None:
    """Replace, in place, the update of every attacker (site id in ``attackers``) among the
    round's typed updates (:class:`fedind.server.pipeline.SiteUpdate`, decoded, before the
    screen's rules) by ``colluding_update`` over every site's honest delta (float arrays),
    cut to the round's top-k budget.
    The classifier bias ``head.bias`` is sent as trained, as in ``bodyflip``: the attackers
    know the screen's label-alignment rule, which reads that array only. In place because
    the pipeline passes these same objects on to the strategy: the attackers know the
    honest updates of the round, and the screen and the strategy see what they send."""
    honest = [u for u in updates if u.has_update and u.weights is not None]
    bad = [u for u in honest if u.site_id in attackers]
    if not bad or len(honest) < 2:
        return
    names = sorted(n for n, w in bad[0].weights.items()
                   if np.issubdtype(w.dtype, np.floating) and n != HONEST_IN_BODYFLIP)
    flat = np.stack([np.concatenate([np.asarray(u.delta[n], np.float64).ravel() for n in names]) for u in honest])
    # The attackers obey the round's top-k budget (the server refuses more): as many values
    # as the fullest honest reply, less those their honest classifier bias takes.
    sent = max(sum(int(np.count_nonzero(d)) for d in u.delta.values()) for u in honest)
    bias = int(np.count_nonzero(bad[0].delta.get(HONEST_IN_BODYFLIP, 0)))
    update = colluding_update(flat, attack, limit=max(sent - bias, 0))
    offsets = np.cumsum([0] + [bad[0].delta[n].size for n in names])
    for u in bad:
        for i, name in enumerate(names):
            w = u.weights[name]
            sent = w.astype(np.float64) - u.delta[name]
            u.weights[name] = (sent + update[offsets[i]:offsets[i + 1]].reshape(w.shape)).astype(w.dtype)
            u.delta[name] = u.weights[name].astype(np.float64) - sent


def relabelled(load: Callable, sites: tuple[int, ...], target: int) -> Callable:
    """``fedind.site.app.load_site_data`` whose training labels at partitions ``sites``
    call class ``target`` healthy (class 0): a line that trains honestly on wrong labels
    (``labelflip``), its histogram reporting them as it believes them."""
    from fedind.data.format import SiteArrays
    from fedind.data.sources import SiteData

    def load_site_data(context, config, phase: int = 0):
        site = load(context, config, phase)
        if int(context.node_config.get("partition-id", -1)) not in sites:
            return site
        y = np.where(site.train.y == target, 0, site.train.y)
        return SiteData(site.site_id, SiteArrays(site.train.x, y), site.test)

    return load_site_data


def class_recall(config, folder: Path) -> list[float | None]:
    """Per-class recall of the run's final model on the server's test set (every phase's, together)."""
    import torch

    from fedind.data.sources import global_test_set, phase_test_set
    from fedind.models import FaultCNN
    from fedind.server.checkpoint import CheckpointStore
    from fedind.data.format import SiteArrays
    from fedind.training import evaluate

    arrays = CheckpointStore(folder / "checkpoints").load_latest().arrays
    model = FaultCNN.from_state_dict({k: torch.from_numpy(np.array(v)) for k, v in arrays.items()})
    if config.phases > 1:
        sets = [phase_test_set(config.drift_spec(), config.data_root, q) for q in range(config.phases)]
    else:
        sets = [global_test_set(config.federation_spec(), config.data_root)]
    x, y = np.concatenate([t.x for t in sets]), np.concatenate([t.y for t in sets])
    known = y < model.head.out_features  # a class the head never grew (its holder kept out) is never recognised
    confusion = evaluate(model, SiteArrays(x[known], y[known]), torch.device("cpu")).confusion
    totals = confusion.sum(axis=1)
    recall = [float(confusion[c, c] / totals[c]) if totals[c] else None for c in range(len(totals))]
    return recall + [0.0 if np.any(y == c) else None for c in range(len(totals), int(y.max()) + 1)]


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


def recording_screen(rows: list[dict], collusion: tuple[Attack, set[str]] | None = None) -> type[UpdateScreen]:
    """The server's :class:`UpdateScreen`, also appending to ``rows`` every train reply's
    update norm, its ratio to the round's median norm, its cosine to the coordinate-wise
    median update of the round and whether the screen rejected it. ``collusion``:
    ``(attack, attacker site ids)`` of a colluding attack, applied to the updates before
    the rules (:func:`collude`)."""

    class RecordingScreen(UpdateScreen):
        def rules(self, updates: list) -> dict:
            if collusion is not None:
                collude(updates, *collusion)
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
                nodes = list(norms)
                cosines = dict(zip(nodes, consensus_cosines([norms[node][1] for node in nodes])))
                bodies = {u.node_id: np.concatenate([d.ravel() for k, d in sorted(u.delta.items()) if not k.startswith("head.")])
                          for u in updates if u.has_update}
                body_cosines = dict(zip(nodes, consensus_cosines([bodies[node] for node in nodes])))
                rejected = {updates[i].node_id for i, v in verdicts.items() if isinstance(v, str)}
                for node, (site, flat) in sorted(norms.items(), key=lambda kv: kv[1][0]):
                    rows.append({"round": server_round, "site": site, "norm": lengths[node],
                                 "ratio_to_median": lengths[node] / median,
                                 "cosine_to_median_update": float(cosines[node]),
                                 "body_cosine_to_median_update": float(body_cosines[node]),
                                 "peer_cosine": peers.get(node, float("nan")),
                                 "peer_cosine_head": peers_head.get(node, float("nan")),
                                 "label_alignment": alignments.get(node, float("nan")),
                                 "rejected": node in rejected})
            return verdicts

    return RecordingScreen


def measure(
    config, attack: Attack | None, sites: tuple[int, ...], name: str, out: Path, runtime: str = "ray"
) -> dict:
    """One run's figures (running it unless its results exist); the run's folder also gets
    ``norms.csv``: every train reply's update norm, its ratio to the round's median and its
    cosine to the round's coordinate-wise median update (see :func:`recording_screen`)."""
    folder = out / "runs" / name
    if not (folder / "summary.json").exists():
        app = attacked_app(attack, sites) if attack is not None else None
        norms: list[dict] = []
        collusion = None
        if attack is not None and attack.kind in OMNISCIENT:
            from fedind.data.federation import site_ids

            collusion = (attack, {site_ids(config.num_sites)[i] for i in sites})
        load = fedind.site.app.load_site_data
        if attack is not None and attack.kind == "labelflip":
            load = relabelled(load, sites, int(attack.strength))
        with mock.patch.object(fedind.server.app, "UpdateScreen", recording_screen(norms, collusion)), \
                mock.patch.object(fedind.site.app, "load_site_data", load):
            simulate(replace(config, run_dir=str(out / "runs"), run_name=name), client_app=app, runtime=runtime)
        with open(folder / "norms.csv", "w", newline="") as f:
            fields = ["round", "site", "norm", "ratio_to_median", "cosine_to_median_update", "body_cosine_to_median_update", "peer_cosine",
                      "peer_cosine_head", "label_alignment", "rejected"]
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(norms)
    if not (folder / "recall.json").exists():
        (folder / "recall.json").write_text(json.dumps(class_recall(config, folder)))
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
        "recall": json.loads((folder / "recall.json").read_text()),
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", nargs="+", default=["fedavg", "fedavgm", "fedmedian", "fedtrimmedavg", "krum"])
    parser.add_argument("--attacks", nargs="+", default=["scale10", "scale100", "signflip1", "signflip4"])
    parser.add_argument("--sites", type=int, nargs="+", default=[0], help="partition ids of the attacked sites")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--runtime", default="ray", help="fedind.simulation runtime: ray or loopback (one process)")
    parser.add_argument("--out", default="runs/poisoning")
    parser.add_argument("--no-run", action="store_true", help="tabulate the finished runs only, run nothing")
    args, overrides = parser.parse_known_args(argv)
    base = parse_overrides(overrides)
    attacks = {CLEAN: None} | {a.name: a for a in map(Attack.parse, args.attacks)}
    strategies = list(dict.fromkeys(args.strategies))
    sites = tuple(args.sites)
    if args.runtime != "loopback" and any(a is not None and a.kind == "labelflip" for a in attacks.values()):
        raise SystemExit("labelflip relabels the site's data in this process: run it with --runtime loopback")
    if any(not 0 <= s < base.num_sites for s in sites):
        raise SystemExit(f"--sites {list(sites)}: partition ids are 0..{base.num_sites - 1}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    # The configured strategy's clean run (pyproject's: the recipe's) is every row's second reference.
    reference = base.strategy
    order = ([(reference, CLEAN)] if reference not in strategies else []) + [
        (s, a) for s in strategies for a in attacks
    ]
    if args.no_run:  # only the variants whose runs all exist, and only rows with both clean references
        done = {(s, a) for s, a in order if all(
            (out / "runs" / f"{s}-{a}-seed{seed}" / "summary.json").exists() for seed in args.seeds)}
        order = [(s, a) for s, a in order if {(s, a), (s, CLEAN), (reference, CLEAN)} <= done]
        if not order:
            raise SystemExit(f"--no-run: no finished runs to tabulate in {out / 'runs'}")
    runs: dict[tuple[str, str], list[dict]] = {}
    for seed in args.seeds:
        for strategy, attack in order:
            name = f"{strategy}-{attack}-seed{seed}"
            config = replace(base, strategy=strategy, seed=seed)
            figures = measure(config, attacks[attack], sites, name, out, args.runtime)
            runs.setdefault((strategy, attack), []).append({"seed": seed, **figures})
            print(f"{name}: final {figures['final_accuracy']:.4f}, rejected {figures['rejected']}", flush=True)

    results = [_summarise(s, a, r, runs, reference) for (s, a), r in runs.items() if s in strategies]
    strategies = [s for s in strategies if any(r["strategy"] == s for r in results)]
    share = _attacked_share(base, sites)
    table = _table(results, base, args.seeds, sites, share, reference)
    (out / "table.md").write_text(table + "\n")
    (out / "results.json").write_text(
        json.dumps(
            {
                "base": base.to_flower(),
                "strategies": strategies,
                "attacks": list(attacks),
                "attacked_sites": list(sites),
                "attacked_share_of_examples": share,
                "norm_clip": base.norm_clip,
                "seeds": args.seeds,
                "results": [{k: v for k, v in r.items() if k != "curve"} for r in results],
                "runs": {f"{s}/{a}": r for (s, a), r in runs.items()},
            },
            indent=2,
        )
    )
    _plot(results, strategies, list(attacks), out / "poisoning.png", reference)
    print(table)


def _summarise(strategy: str, attack: str, runs: list[dict], all_runs: dict, reference: str) -> dict:
    """Means over seeds; drops are taken seed by seed against the clean references, and
    against the same strategy's ``absent`` runs when the grid has them (what the attack
    costs beyond losing the attacked lines' data: the floor of any defence that keeps them
    out, which is not 0 where an attacked line is the only holder of a class)."""
    own, default = all_runs[(strategy, CLEAN)], all_runs[(reference, CLEAN)]
    absent = all_runs.get((strategy, "absent"))
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
        "drop_vs_absent": None if absent is None or attack in (CLEAN, "absent") else statistics.fmean(
            a["final_accuracy"] - r["final_accuracy"] for r, a in zip(runs, absent)
        ),
        "rejected": [r["rejected"] for r in runs],
        "rounds": runs[0]["rounds"],
        "recall": [statistics.fmean(x for x in c if x is not None) if any(x is not None for x in c) else None
                   for c in zip(*(r["recall"] for r in runs))],
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
    results: list[dict], base, seeds: list[int], sites: tuple[int, ...], share: float | None,
    reference: str,
) -> str:
    held = f" ({100 * share:.1f} % of the training windows)" if share is not None else ""
    clipped = (f" Screen's norm clip at {base.norm_clip:g}x the round's median update norm." if base.norm_clip > 0
               else " No norm clip.")
    lines = [
        f"{base.num_server_rounds} rounds, {base.num_sites} sites, Dirichlet alpha {base.dirichlet_alpha}, "
        f"seeds {', '.join(map(str, seeds))}; attacked site(s) {', '.join(map(str, sites))}{held}, every round. "
        f"Drops in points of final accuracy (positive = worse); rejected = replies the server screened out, "
        f"summed over rounds (per seed); recall = per-class recall of the final model on the server's test "
        f"set, class 0 first (mean over seeds); drop vs absent = what the attack costs beyond losing the "
        f"attacked lines' data (against the same strategy's `absent` runs, when the grid has them).{clipped}",
        "",
        f"| strategy | attack | final acc. | best acc. | drop vs own clean | drop vs {reference} clean "
        f"| drop vs absent | rejected | recall per class |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        std = f" ± {r['final_std']:.3f}" if len(seeds) > 1 else ""
        own = "–" if r["attack"] == CLEAN else f"{100 * r['drop_vs_clean']:+.1f}"
        beyond = "–" if r.get("drop_vs_absent") is None else f"{100 * r['drop_vs_absent']:+.1f}"
        lines.append(
            f"| {r['strategy']} | {r['attack']} | {r['final']:.3f}{std} | {r['best']:.3f} | {own} "
            f"| {100 * r['drop_vs_default_clean']:+.1f} | {beyond} | {', '.join(map(str, r['rejected']))} "
            f"| {' '.join('–' if x is None else f'{x:.2f}' for x in r['recall'])} |"
        )
    return "\n".join(lines)


def _plot(results: list[dict], strategies: list[str], attacks: list[str], path: Path, reference: str) -> None:
    with saved_figure(path, 1, 2, figsize=(13, 4.5)) as (fig, (ax_bar, ax_curve)):
        by_key = {(r["strategy"], r["attack"]): r for r in results}
        shown = [a for a in attacks if any((s, a) in by_key for s in strategies)]
        width = 0.8 / max(1, len(shown))
        for j, attack in enumerate(shown):
            xs = [i + (j - (len(shown) - 1) / 2) * width for i, s in enumerate(strategies) if (s, attack) in by_key]
            ys = [by_key[(s, attack)]["final"] for s in strategies if (s, attack) in by_key]
            ax_bar.bar(xs, ys, width, label=attack)
        clean = by_key.get((reference, CLEAN))
        if clean is not None:
            ax_bar.axhline(clean["final"] - 0.02, color="black", linestyle="--", linewidth=1,
                           label=f"{reference} clean − 2 points")
        ax_bar.set_xticks(range(len(strategies)), strategies)
        ax_bar.set(ylabel="final global test accuracy", ylim=(0, 1), title="final accuracy by strategy and attack")
        ax_bar.grid(alpha=0.3, axis="y")
        ax_bar.legend(fontsize=8)
        for attack in shown:
            r = by_key.get((reference, attack))
            if r is not None:
                ax_curve.plot(range(1, len(r["curve"]) + 1), r["curve"], label=attack)
        ax_curve.set(xlabel="round", ylabel="global test accuracy", ylim=(0, 1), title=f"{reference} per round")
        ax_curve.grid(alpha=0.3)
        ax_curve.legend(fontsize=8)


if __name__ == "__main__":
    main(sys.argv[1:])
