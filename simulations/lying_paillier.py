"""One lying site under Paillier encryption: how far it moves the decrypted mean, and how
often the decrypting site's range check (fedind.paillier.packing.sum_fault) refuses the round.

Packing level, no training: each round ``--sites`` sites (equal num-examples) send a delta of
``--values`` values drawn from N(0, ``--sigma``^2), clipped to ``c = --clip``, encrypted under a
fresh ``--key-bits`` key (real ciphertexts); site 0 lies, i.e. encrypts the plaintext of its
attack instead. The server sums with integer weights and one site decrypts the sum under
one of three checks:

- ``none``: no check (every slot decoded modulo its 24 bits; K = 512);
- ``slot-max, K=1024``: the check before the guard bit (a slot above W * 2Q or a bit above
  the last slot is refused; weights summing to 1024, so honest sums fill the slot);
- ``guard, K=512``: the check now (sum_fault: also the guard bit and the padding).

Effect: the decrypted mean minus the mean of the same round with site 0 honest, on the
rounds the check accepts (a refused round keeps the model: effect 0). Attacks:

- ``honest``: its clipped update (the false-refusal check);
- ``scaled-x<s>``: its delta times s, not clipped (levels past [0, 2Q] carry or borrow);
- ``few-x1e5``: 10 of its values times 1e5, the rest honest (a targeted lie);
- ``garbage``: uniformly random 24-bit slots (a broken encoder);
- ``range-aware``: +0.9 c on every value, scaled by W / k so that the SUM stays in range
  (what a site that knows the weights can do: no check on the sum can see it).

    python simulations/lying_paillier.py --rounds 20 --out runs/lying-paillier

Writes OUT/{results.json,table.md,config.json}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import gmpy2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedind.paillier import keys, packing  # noqa: E402
from fedind.paillier.packing import (  # noqa: E402
    VALUE_MAX,
    SumOutOfRange,
    dequantise,
    integer_weights,
    quantise,
    sum_fault,
    unpack,
)

SLOT_BITS = packing.SLOT_BITS
CHECKS = ("none", "slot-max, K=1024", "guard, K=512")
ATTACKS = ("honest", "scaled-x10", "scaled-x1000", "scaled-x1e5", "few-x1e5", "garbage", "range-aware")


def plaintexts(levels, slots: int, n: int) -> list[int]:
    """``sum_s l_s 2^(24 s) mod n`` per block of ``slots`` levels, whatever the levels."""
    out = []
    for start in range(0, len(levels), slots):
        m = 0
        for s, level in enumerate(levels[start : start + slots]):
            m += int(level) << (SLOT_BITS * s)
        out.append(m % n)
    return out


def encrypt(ms: list[int], key) -> list[int]:
    n, n2 = gmpy2.mpz(key.public.n), gmpy2.mpz(key.public.n_square)
    return [int((1 + m * n) % n2 * r % n2) for m, r in zip(ms, key.obfuscators(len(ms)))]


def weighted(cts: list[list[int]], weights: list[int], n2: int) -> list[int]:
    """``prod_i c_i^k_i mod n^2`` (as packing.weighted_sum, without its K = 512 bound)."""
    out = []
    for j in range(len(cts[0])):
        acc = gmpy2.mpz(1)
        for c, k in zip(cts, weights):
            acc = acc * gmpy2.powmod(c[j], k, n2) % n2
        out.append(int(acc))
    return out


def decode(ms: list[int], slots: int, count: int, weight: int, clip: float, check: str) -> np.ndarray | None:
    """The decrypted mean under ``check``, or None when the check refuses the sum."""
    if check == "none":
        ms = [m & ((1 << (slots * SLOT_BITS)) - 1) for m in ms]
    try:
        sums = unpack(ms, slots)
    except SumOutOfRange:
        return None
    if check == "slot-max, K=1024" and sums[:count].max() > weight * 2 * VALUE_MAX:
        return None
    if check == "guard, K=512" and sum_fault(sums, weight, count) is not None:
        return None
    return dequantise(sums[:count], weight, clip).astype(np.float64)


def lie(attack: str, delta: np.ndarray, clip: float, share: float, rng: np.random.Generator) -> list[int]:
    """Site 0's levels under ``attack`` (``share`` = its weight k / W)."""
    honest, _ = quantise(delta, clip, rng)
    if attack == "honest":
        return honest.tolist()
    if attack.startswith("scaled-x"):
        scale = float(attack.removeprefix("scaled-x"))
        return [int(v) for v in np.rint(scale * delta * VALUE_MAX / clip) + VALUE_MAX]
    if attack == "few-x1e5":
        levels = honest.astype(object)
        for j in rng.choice(delta.size, 10, replace=False):
            levels[j] = int(np.rint(1e5 * delta[j] * VALUE_MAX / clip)) + VALUE_MAX
        return list(levels)
    if attack == "garbage":
        return rng.integers(0, 2**SLOT_BITS, delta.size).tolist()
    if attack == "range-aware":
        return [VALUE_MAX + int(round(0.9 * VALUE_MAX / share))] * delta.size
    raise ValueError(f"Invalid attack: {attack!r}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--sites", type=int, default=10)
    parser.add_argument("--values", type=int, default=4096)
    parser.add_argument("--sigma", type=float, default=0.01)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--key-bits", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/lying-paillier")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(vars(args), indent=1))
    rng = np.random.default_rng(args.seed)
    key = keys.generate_keypair(args.key_bits)
    slots, n, n2 = packing.FINE.slots(key.public), key.public.n, key.public.n_square
    k512 = integer_weights(np.ones(args.sites))
    by_k = {512: k512, 1024: [2 * k for k in k512]}  # the same shares with one bit less of guard
    records = {(a, c): {"refused": 0, "rel": [], "max": []} for a in ATTACKS for c in CHECKS}
    for _ in range(args.rounds):
        deltas = rng.normal(0.0, args.sigma, (args.sites, args.values))
        honest = [encrypt(plaintexts(quantise(d, args.clip, rng)[0], slots, n), key) for d in deltas[1:]]
        liars = {a: encrypt(plaintexts(lie(a, deltas[0], args.clip, k512[0] / 512, rng), slots, n), key)
                 for a in ATTACKS}
        for total, weights in by_k.items():
            sums = {a: key.decrypt_many(weighted([liars[a], *honest], weights, n2)) for a in ATTACKS}
            for check in CHECKS:
                if (total == 1024) != (check == "slot-max, K=1024"):
                    continue
                reference = decode(sums["honest"], slots, args.values, total, args.clip, "none")
                for attack in ATTACKS:
                    mean = decode(sums[attack], slots, args.values, total, args.clip, check)
                    entry = records[(attack, check)]
                    if mean is None:
                        entry["refused"] += 1
                        continue
                    entry["rel"].append(float(np.linalg.norm(mean - reference) / np.linalg.norm(reference)))
                    entry["max"].append(float(np.abs(mean - reference).max() / args.clip))
    results = [
        {"attack": a, "check": c, "refused": r["refused"] / args.rounds,
         "effect_rel": float(np.mean(r["rel"])) if r["rel"] else None,
         "effect_max_over_clip": float(np.max(r["max"])) if r["max"] else None}
        for (a, c), r in records.items()
    ]
    (out / "results.json").write_text(json.dumps(results, indent=1))
    lines = [
        "| site 0 sends | check | rounds refused | accepted: ‖Δ mean‖ / ‖honest mean‖ | accepted: max |Δ| / c |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        rel = "–" if r["effect_rel"] is None else f"{r['effect_rel']:.3g}"
        top = "–" if r["effect_max_over_clip"] is None else f"{r['effect_max_over_clip']:.3g}"
        lines.append(f"| {r['attack']} | {r['check']} | {r['refused']:.0%} | {rel} | {top} |")
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main(sys.argv[1:])
