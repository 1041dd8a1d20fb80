"""Uplink compression trials that did not beat fedind's top-k: the runs behind the README's
*Top-k sparse uplink*, "Tried and dropped (2026-12-02, afternoon)".

Each trial is a site mod that replaces fedind's top-k mod (``fedind.transport.topk_mod``)
in the site agent; the server is fedind's, unchanged. Trials whose payload fedind's codec
cannot carry (low-rank factors, seeded random subsets) send the reconstructed update as
dense weights with the gain applied at the site, so their accuracy is what the method
gives, but the bytes the metering grid counts are dense: ``--bytes`` prints what their own
wire format would cost per reply (from the model's shapes).

    python simulations/compression_trials.py shared-mask --seeds 4      # one trial, seed 4
    python simulations/compression_trials.py lowrank --rank 2 --seeds 4
    python simulations/compression_trials.py lowrank --rank 2 --bytes   # bytes only, no run
    python simulations/topk_allocation.py seed=4 --ratios 0.015         # saves dense updates, then:
    python simulations/compression_trials.py lowrank --energy runs/topk-allocation/updates-seed4

Trials (top-k defaults from pyproject: ratio 0.015, int4, residual decay 0.8, gain 1.5):

- ``dense-lines``: the sites of ``--lines`` send dense updates, the others top-k
  (is a line's own uplink what holds its accuracy back?).
- ``shared-mask``: time-correlated sparsification. Every site sends its values at the
  ``--mask`` x k coordinates that moved most in the last global change (the same for every
  site, so a real format needs no indices for them) plus its own top ``--own`` x k of the
  rest, int8, with error feedback. This script sends their indices too (fedind's codec).
- ``ramp``: top-k whose density grows linearly from ``--ramp LOW`` to ``HIGH`` times the
  ratio over the rounds after the warm-up (the same mean density).
- ``lowrank``: each array of 2 or more dimensions, reshaped to (first dim, rest), is sent
  as its best rank-``--rank`` approximation (SVD) in two int4 factors; 1-D arrays int8;
  error feedback as top-k's (PowerSGD's idea, without the power iteration).
- ``random-sign``: a random ``--fraction`` of the coordinates (drawn from a seed both
  sides know, so no indices), each sent as its sign times the array's mean magnitude over
  the drawn coordinates; error feedback.
- ``dense-1d``: the 1-D arrays (GroupNorm weights and biases, the head's bias) sent whole
  in int8 (``--one-d int4``: int4), top-k (the same k as over the whole model) over the rest.

Results go to OUT/<trial>-seed<N> (OUT = --out, runs/compression-trials); finished runs
are reused. ``key=value`` overrides (before the options) change the run config.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulations.common import parse_overrides  # noqa: E402

from fedind import wire  # noqa: E402
from fedind.clientapp import evaluate_global, state_mod, train  # noqa: E402
from fedind.compression import (  # noqa: E402
    ErrorFeedback,
    SparseTensor,
    dequantise,
    encode,
    quantise,
    to_record,
    topk_indices,
    warmup_ratio,
)
from fedind.config import RunConfig  # noqa: E402
from fedind.models import FaultCNN  # noqa: E402
from fedind.simulation import simulate  # noqa: E402
from fedind.transport import topk_mod  # noqa: E402

RESIDUALS = "trial-residuals"
PREVIOUS = "trial-previous-global"


def quantised(values: np.ndarray, mode: str) -> np.ndarray:
    """``values`` after quantise + dequantise (zeros stay zero, as they are never sent)."""
    flat = np.asarray(values, np.float32).ravel()
    out = np.zeros_like(flat)
    nonzero = flat != 0
    if nonzero.any():
        codes, scale = quantise(flat[nonzero], mode)
        out[nonzero] = dequantise(codes, scale, mode)
    return out.reshape(np.shape(values))


def lowrank(update: np.ndarray, rank: int) -> np.ndarray:
    """Best rank-``rank`` approximation of ``update`` as (first dim, rest), int4 factors."""
    matrix = update.reshape(update.shape[0], -1)
    u, s, vt = np.linalg.svd(matrix, full_matrices=False)
    r = min(rank, len(s))
    left = quantised(u[:, :r] * np.sqrt(s[:r]), "int4")
    right = quantised(vt[:r].T * np.sqrt(s[:r]), "int4")
    return (left @ right.T).reshape(update.shape)


def random_sign(update: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Sign times mean magnitude on a random ``fraction`` of the coordinates, zero elsewhere."""
    picked = rng.random(update.shape) < fraction
    out = np.zeros_like(update)
    if picked.any():
        out[picked] = np.sign(update[picked]) * np.float32(np.abs(update[picked]).mean())
    return out


def reply_bytes(trial: str, args, ratio: float, width: int = 32, num_classes: int = 10) -> str:
    """What a reply of ``trial`` would take in its own format (model of fedind's default
    shape; 300 bytes of metrics, histogram and framing as measured for top-k replies)."""
    shapes = [tuple(t.shape) for t in FaultCNN(1, num_classes, width).state_dict().values()]
    one_d = sum(int(np.prod(s)) for s in shapes if len(s) < 2)
    if trial == "lowrank":
        factors = sum(args.rank * (s[0] + int(np.prod(s[1:]))) for s in shapes if len(s) >= 2)
        size = 300 + (factors + 1) // 2 + 8 * sum(len(s) >= 2 for s in shapes) + one_d + 4 * len(shapes)
        return f"{size} bytes"
    if trial == "random-sign":
        total = sum(int(np.prod(s)) for s in shapes)
        return f"{300 + int(np.ceil(args.fraction * total / 8)) + 4 * len(shapes) + 8} bytes"
    if trial == "shared-mask":
        masked = round(args.mask * ratio * sum(int(np.prod(s)) for s in shapes))
        return (f"{(masked + 1) // 2} bytes of int4 values at the {masked} mask coordinates (no indices: the "
                f"server knows the mask) + a top-k reply of {args.own:g} k (metered: int8 with indices)")
    if trial == "dense-1d":
        values = one_d if args.one_d == "int8" else sum((int(np.prod(s)) + 1) // 2 for s in shapes if len(s) < 2)
        scales = 4 * sum(len(s) < 2 for s in shapes)
        return f"a top-k reply + {values + scales} bytes (1-D arrays {args.one_d}, with scales)"
    return "as metered (fedind's top-k payload)"


def energy_captured(updates_dir: Path, ratio: float, ranks: tuple[int, ...] = (1, 2)) -> list[str]:
    """Per round, the mean over sites of the share of ``||u||^2`` that top-k at ``ratio``
    and that rank-r per array (1-D arrays whole) keep, on dense updates saved by
    ``simulations/topk_allocation.py`` (one round's fidelity, no error feedback)."""
    from simulations.topk_allocation import load_updates

    shapes = [tuple(t.shape) for _, t in sorted(FaultCNN(1, 10, 32).state_dict().items())]
    offsets = np.concatenate([[0], np.cumsum([int(np.prod(s)) for s in shapes])])
    lines = []
    for server_round, sites in sorted(load_updates(updates_dir).items()):
        shares = []
        for _, update in sites.values():
            total = float(update @ update)
            top = np.sort(np.abs(update))[::-1][: round(ratio * update.size)]
            row = [float(top @ top) / total]
            for rank in ranks:
                kept = 0.0
                for shape, lo, hi in zip(shapes, offsets[:-1], offsets[1:]):
                    part = update[lo:hi]
                    if len(shape) >= 2:
                        singular = np.linalg.svd(part.reshape(shape[0], -1), compute_uv=False)
                        kept += float(singular[:rank] @ singular[:rank])
                    else:
                        kept += float(part @ part)
                row.append(kept / total)
            shares.append(row)
        mean = np.mean(shares, axis=0)
        lines.append(f"round {server_round}: top-k {ratio:g} keeps {mean[0]:.2f}; "
                     + ", ".join(f"rank {r} keeps {m:.2f}" for r, m in zip(ranks, mean[1:])))
    return lines


def replaced(instruction: Message, reply: Message, arrays: dict[str, np.ndarray] | None = None,
             payload: bytes | None = None, started: float = 0.0) -> Message:
    """``reply`` (to ``instruction``) with its dense weights replaced by ``arrays`` or by a
    ``sparse-update`` payload."""
    content = RecordDict({k: r for k, r in reply.content.items() if k != wire.ARRAYS})
    if arrays is not None:
        content[wire.ARRAYS] = ArrayRecord({n: Array(np.ascontiguousarray(a)) for n, a in arrays.items()})
    if payload is not None:
        content[wire.SPARSE_UPDATE] = to_record(payload)
    content[wire.METRICS][wire.COMPRESS_SECONDS] = time.process_time() - started
    return Message(content, reply_to=instruction)


def trial_mod(trial: str, args):
    """The site mod of ``trial`` (see the module docstring)."""

    def mod(msg, context, call_next):
        if trial == "dense-lines":
            partition = int(context.node_config.get("partition-id", -1))
            if msg.metadata.message_type == MessageType.TRAIN and partition in args.lines:
                config_record = msg.content[wire.CONFIG]
                values = json.loads(str(config_record[wire.RUN_CONFIG]))
                config_record[wire.RUN_CONFIG] = json.dumps({**values, "compression": "none"})
                reply = call_next(msg, context)
                if not reply.has_error():
                    reply.content[wire.METRICS][wire.COMPRESS_SECONDS] = 0.0
                return reply
            return topk_mod(msg, context, call_next)
        reply = call_next(msg, context)
        if msg.metadata.message_type != MessageType.TRAIN or reply.has_error():
            return reply
        started = time.process_time()
        config = RunConfig.from_json(str(msg.content[wire.CONFIG][wire.RUN_CONFIG]))
        server_round = int(msg.content[wire.CONFIG][wire.SERVER_ROUND])
        sent, local = msg.content[wire.ARRAYS], reply.content[wire.ARRAYS]
        names = list(sent)
        base = {n: sent[n].numpy().astype(np.float32) for n in names}
        update = {n: local[n].numpy().astype(np.float32) - base[n] for n in names}
        if RESIDUALS in context.state:  # error feedback: carry the decayed residual
            held = context.state[RESIDUALS]
            update = {n: update[n] + config.topk_residual_decay * held[n].numpy() for n in names}
        ratio = warmup_ratio(config.topk_ratio, server_round, config.topk_warmup_rounds)
        if trial == "ramp" and server_round > config.topk_warmup_rounds:
            low, high = args.ramp
            progress = (server_round - config.topk_warmup_rounds - 1) / max(
                1, config.num_server_rounds - config.topk_warmup_rounds - 1)
            ratio = config.topk_ratio * (low + (high - low) * progress)

        if trial in ("lowrank", "random-sign", "dense-1d"):
            # random-sign: both sides could draw the subset from (seed, round, site)
            partition = int(context.node_config.get("partition-id", 0))
            rng = np.random.default_rng([config.seed, server_round, partition])
            if trial == "dense-1d":
                two_d = {n: u for n, u in update.items() if u.ndim >= 2}
                total = sum(u.size for u in update.values())
                scale = total / sum(u.size for u in two_d.values())  # the same k as over the whole model
                sparse = ErrorFeedback(mode=config.topk_quantization).compress(two_d, min(1.0, ratio * scale))
            sent_update = {}
            for n in names:
                if trial == "lowrank":
                    two_or_more = update[n].ndim >= 2
                    sent_update[n] = lowrank(update[n], args.rank) if two_or_more else quantised(update[n], "int8")
                elif trial == "random-sign":
                    sent_update[n] = random_sign(update[n], args.fraction, rng)
                else:
                    sent_update[n] = sparse[n].to_dense() if n in sparse else quantised(update[n], args.one_d)
            context.state[RESIDUALS] = ArrayRecord({n: Array(update[n] - sent_update[n]) for n in names})
            return replaced(msg, reply, {n: base[n] + np.float32(config.topk_gain) * sent_update[n] for n in names},
                            started=started)

        # shared-mask and ramp: a real sparse payload through fedind's codec and server
        shapes = [update[n].shape for n in names]
        offsets = np.concatenate([[0], np.cumsum([u.size for u in update.values()])]).astype(np.int64)
        flat = np.concatenate([update[n].ravel() for n in names])
        global_flat = np.concatenate([base[n].ravel() for n in names])
        k = max(1, round(ratio * flat.size))
        # shared-mask: int8, one scale for the mask's small values and the own picks' large ones
        mode = "int8" if trial == "shared-mask" else config.topk_quantization
        if trial == "shared-mask" and PREVIOUS in context.state and server_round > config.topk_warmup_rounds:
            change = np.abs(global_flat - context.state[PREVIOUS]["w"].numpy())
            mask = topk_indices(change, round(args.mask * config.topk_ratio * flat.size))
            rest = np.abs(flat)
            rest[mask] = 0
            chosen = np.union1d(mask, topk_indices(rest, round(args.own * config.topk_ratio * flat.size)))
        else:
            chosen = topk_indices(np.abs(flat), k)
        context.state[PREVIOUS] = ArrayRecord({"w": Array(global_flat)})
        chosen = chosen[flat[chosen] != 0]
        bounds = np.searchsorted(chosen, offsets)
        sparse = {}
        for i, n in enumerate(names):
            picked = chosen[bounds[i]:bounds[i + 1]]
            codes, scale = quantise(flat[picked], mode)
            sparse[n] = SparseTensor(shapes[i], picked - offsets[i], codes, scale, mode)
            flat[picked] -= sparse[n].values()
        context.state[RESIDUALS] = ArrayRecord(
            {n: Array(flat[lo:hi].reshape(s).copy()) for n, s, lo, hi in zip(names, shapes, offsets[:-1], offsets[1:])})
        return replaced(msg, reply, payload=encode(sparse), started=started)

    return mod


def trial_app(trial: str, args) -> ClientApp:
    site = ClientApp(mods=[state_mod, trial_mod(trial, args)])
    site.train()(train)
    site.evaluate()(evaluate_global)
    return site


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trial", choices=["dense-lines", "shared-mask", "ramp", "lowrank", "random-sign", "dense-1d"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[4])
    parser.add_argument("--lines", type=int, nargs="+", default=[8, 9])
    parser.add_argument("--mask", type=float, default=2.0, help="shared-mask: mask size in units of k")
    parser.add_argument("--own", type=float, default=0.5, help="shared-mask: own picks in units of k")
    parser.add_argument("--ramp", type=float, nargs=2, default=[0.5, 1.5])
    parser.add_argument("--rank", type=int, default=2)
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--one-d", choices=["int8", "int4"], default="int8",
                        help="dense-1d: the 1-D arrays' quantisation")
    parser.add_argument("--bytes", action="store_true", help="print the per-reply bytes of the trial's format and stop")
    parser.add_argument("--energy", type=Path, help="lowrank: energy kept per round on the dense updates saved here "
                        "by simulations/topk_allocation.py, and stop")
    parser.add_argument("--out", default="runs/compression-trials")
    args, overrides = parser.parse_known_args(argv)
    if args.energy is not None:
        print("\n".join(energy_captured(args.energy, parse_overrides(overrides).topk_ratio)))
        return
    if args.bytes:
        print(f"{args.trial}: {reply_bytes(args.trial, args, parse_overrides(overrides).topk_ratio)} per reply")
        return
    base = parse_overrides(overrides)
    # dense-lines, shared-mask and ramp send fedind payloads; the others dense weights
    compression = "topk" if args.trial in ("dense-lines", "shared-mask", "ramp") else "none"
    for seed in args.seeds:
        name = f"{args.trial}-seed{seed}"
        config = replace(base, seed=seed, compression=compression, run_dir=args.out, run_name=name)
        folder = Path(args.out) / name
        if not (folder / "summary.json").exists():
            simulate(config, client_app=trial_app(args.trial, args))
        summary = json.loads((folder / "summary.json").read_text())
        sites = ", ".join(f"{site} {r['accuracy']:.2f}" for site, r in summary["per_site"].items())
        print(f"{name}: final {summary['final_accuracy']:.4f}, best {summary['best_accuracy']:.4f}; {sites}",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
