"""Uplink compression trials that did not beat fedind's top-k: the runs behind the README's
*Top-k sparse uplink*, "Tried and dropped (2026-12-02, afternoon)".

Each trial is a site mod that replaces fedind's top-k mod (``fedind.topk.uplink.topk_mod``)
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulations.common import parse_overrides  # noqa: E402

from fedind import wire  # noqa: E402
from fedind.site.app import site_app  # noqa: E402
from fedind.topk.codec import encode, to_record  # noqa: E402
from fedind.topk.feedback import ErrorFeedback  # noqa: E402
from fedind.topk.selection import SparseTensor, dequantise, quantise, topk_indices, warmup_ratio  # noqa: E402
from fedind.config import RunConfig  # noqa: E402
from fedind.models import FaultCNN  # noqa: E402
from fedind.simulation import simulate  # noqa: E402
from fedind.topk.uplink import topk_mod  # noqa: E402

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


def model_shapes(width: int = 32, num_classes: int = 10) -> list[tuple[int, ...]]:
    """Array shapes of fedind's default FaultCNN, in sorted-name order (the wire's order)."""
    return [tuple(t.shape) for _, t in sorted(FaultCNN(1, num_classes, width).state_dict().items())]


def reply_bytes(trial: str, args, ratio: float) -> str:
    """What a reply of ``trial`` would take in its own format (model of fedind's default
    shape; 300 bytes of metrics, histogram and framing as measured for top-k replies)."""
    shapes = model_shapes()
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

    shapes = model_shapes()
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


def ramp_ratio(config: RunConfig, server_round: int, low: float, high: float) -> float:
    """The ratio of ``server_round``: the warm-up's, then growing linearly from ``low`` to
    ``high`` times ``topk-ratio`` over the remaining rounds."""
    if server_round <= config.topk_warmup_rounds:
        return warmup_ratio(config.topk_ratio, server_round, config.topk_warmup_rounds)
    progress = (server_round - config.topk_warmup_rounds - 1) / max(
        1, config.num_server_rounds - config.topk_warmup_rounds - 1)
    return config.topk_ratio * (low + (high - low) * progress)


def shared_mask_sparse(update: dict[str, np.ndarray], change: np.ndarray, masked: int, own: int) -> dict:
    """Int8 sparse arrays of ``update`` at the ``masked`` largest coordinates of the flat
    global ``change`` plus the ``own`` largest of the rest (one scale per array)."""
    flat = np.concatenate([u.ravel() for u in update.values()])
    mask = topk_indices(change, masked)
    rest = np.abs(flat)
    rest[mask] = 0
    chosen = np.union1d(mask, topk_indices(rest, own))
    chosen = chosen[flat[chosen] != 0]  # zeros are never sent
    offsets = np.concatenate([[0], np.cumsum([u.size for u in update.values()])]).astype(np.int64)
    bounds = np.searchsorted(chosen, offsets)
    sparse = {}
    for i, (name, u) in enumerate(update.items()):
        picked = chosen[bounds[i]:bounds[i + 1]]
        codes, scale = quantise(flat[picked], "int8")
        sparse[name] = SparseTensor(u.shape, picked - offsets[i], codes, scale, "int8")
    return sparse


def dense_lines_mod(lines):
    """fedind's top-k mod, except that the sites of ``lines`` send dense updates."""

    def mod(msg, context, call_next):
        if msg.metadata.message_type != MessageType.TRAIN or int(context.node_config.get("partition-id", -1)) \
                not in lines:
            return topk_mod(msg, context, call_next)
        config_record = msg.content[wire.CONFIG]
        values = json.loads(str(config_record[wire.RUN_CONFIG]))
        config_record[wire.RUN_CONFIG] = json.dumps({**values, "compression": "none"})
        reply = call_next(msg, context)
        if not reply.has_error():  # every reply carries the same metric keys
            reply.content[wire.METRICS][wire.COMPRESS_SECONDS] = 0.0
        return reply

    return mod


def trial_mod(trial: str, args):
    """The site mod of ``trial`` (see the module docstring): error feedback around the
    trial's way of choosing what to send."""
    if trial == "dense-lines":
        return dense_lines_mod(set(args.lines))

    def mod(msg, context, call_next):
        reply = call_next(msg, context)
        if msg.metadata.message_type != MessageType.TRAIN or reply.has_error():
            return reply
        started = time.process_time()
        config = RunConfig.from_json(str(msg.content[wire.CONFIG][wire.RUN_CONFIG]))
        server_round = int(msg.content[wire.CONFIG][wire.SERVER_ROUND])
        sent, local = msg.content[wire.ARRAYS], reply.content[wire.ARRAYS]
        base = {n: sent[n].numpy().astype(np.float32) for n in sent}
        update = {n: local[n].numpy().astype(np.float32) - base[n] for n in sent}
        if RESIDUALS in context.state:  # error feedback: carry the decayed residual
            held = context.state[RESIDUALS]
            update = {n: update[n] + config.topk_residual_decay * held[n].numpy() for n in update}
        ratio = warmup_ratio(config.topk_ratio, server_round, config.topk_warmup_rounds)

        if trial in ("ramp", "shared-mask"):  # a real sparse payload through fedind's codec and server
            global_flat = np.concatenate([b.ravel() for b in base.values()])
            if trial == "shared-mask" and PREVIOUS in context.state and server_round > config.topk_warmup_rounds:
                n = global_flat.size
                sparse = shared_mask_sparse(update, np.abs(global_flat - context.state[PREVIOUS]["w"].numpy()),
                                            round(args.mask * config.topk_ratio * n),
                                            round(args.own * config.topk_ratio * n))
            else:
                if trial == "ramp":
                    ratio = ramp_ratio(config, server_round, *args.ramp)
                mode = "int8" if trial == "shared-mask" else config.topk_quantization
                sparse = ErrorFeedback(mode=mode).compress(update, ratio)  # residual already folded in
            if trial == "shared-mask":
                context.state[PREVIOUS] = ArrayRecord({"w": Array(global_flat)})
            context.state[RESIDUALS] = ArrayRecord({n: Array(update[n] - sparse[n].to_dense()) for n in update})
            return replaced(msg, reply, payload=encode(sparse), started=started)

        if trial == "lowrank":
            sent_update = {n: lowrank(u, args.rank) if u.ndim >= 2 else quantised(u, "int8") for n, u in update.items()}
        elif trial == "random-sign":
            # both sides could draw the subset from (seed, round, site): no indices on the wire
            rng = np.random.default_rng([config.seed, server_round, int(context.node_config.get("partition-id", 0))])
            sent_update = {n: random_sign(u, args.fraction, rng) for n, u in update.items()}
        else:  # dense-1d
            two_d = {n: u for n, u in update.items() if u.ndim >= 2}
            total = sum(u.size for u in update.values())
            scale = total / sum(u.size for u in two_d.values())  # the same k as over the whole model
            sparse = ErrorFeedback(mode=config.topk_quantization).compress(two_d, min(1.0, ratio * scale))
            sent_update = {n: sparse[n].to_dense() if n in sparse else quantised(u, args.one_d)
                           for n, u in update.items()}
        context.state[RESIDUALS] = ArrayRecord({n: Array(update[n] - sent_update[n]) for n in update})
        gain = np.float32(config.topk_gain)  # applied here: the server sees dense weights
        return replaced(msg, reply, {n: base[n] + gain * sent_update[n] for n in update}, started=started)

    return mod


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
    base = parse_overrides(overrides)
    if args.energy is not None:
        print("\n".join(energy_captured(args.energy, base.topk_ratio)))
        return
    if args.bytes:
        print(f"{args.trial}: {reply_bytes(args.trial, args, base.topk_ratio)} per reply")
        return
    # dense-lines, shared-mask and ramp send fedind payloads; the others dense weights
    compression = "topk" if args.trial in ("dense-lines", "shared-mask", "ramp") else "none"
    for seed in args.seeds:
        name = f"{args.trial}-seed{seed}"
        config = replace(base, seed=seed, compression=compression, run_dir=args.out, run_name=name)
        folder = Path(args.out) / name
        if not (folder / "summary.json").exists():
            simulate(config, client_app=site_app(transport=trial_mod(args.trial, args)))
        summary = json.loads((folder / "summary.json").read_text())
        sites = ", ".join(f"{site} {r['accuracy']:.2f}" for site, r in summary["per_site"].items())
        print(f"{name}: final {summary['final_accuracy']:.4f}, best {summary['best_accuracy']:.4f}; {sites}",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
