"""Paillier benchmark: per-value phe encryption (naive baseline) vs fedind's packed path.

Same 2048-bit key, same real FaultCNN updates (every site trains one round of the default
scenario from the same initial model), measured side by side in one run:

- encrypt / aggregate / decrypt time per site per round. The naive baseline
  (``phe``: ``public_key.encrypt(float)`` per parameter, ``sum(w_i * Enc(x_i))``,
  ``private_key.decrypt`` per parameter) is timed on a sample of parameters and
  extrapolated to the whole update (it would take minutes per site); the packed path
  (fedind.paillier.packing) is timed on the whole update. Single-core CPU seconds
  (``time.process_time``), plus wall seconds with the obfuscators drawn in 2 processes,
  and the packed aggregate decrypted both ways: the key's short-exponent CRT decryption
  and phe's CRT decryption (exponent p - 1) of the same ciphertexts.
- ciphertext bytes vs float32 bytes (payload, and the serialized Flower record);
- the decrypted aggregate vs the plaintext weighted mean (max error vs the documented bound);
- encrypted vs plaintext simulations (same config, >= 5 sites, >= 5 rounds): final accuracy,
  for DWA with the default server momentum and for DWA weights without server momentum,
  plus a control: the PLAINTEXT run with exactly the encrypted path's two roundings (site
  weights to multiples of 1/K, K = 2^paillier-weight-bits; deltas stochastically rounded to
  the fixed-point grid), which should track the encrypted run; it separates "the encrypted path computes what it documents" from "this
  trajectory is sensitive to a 1e-6 perturbation".

    python simulations/paillier_bench.py                       # 5 sites, 20 rounds, dwa, one phase, dense
    python simulations/paillier_bench.py --rounds 10 --sample 100 --variants dwa --no-control

Writes OUT/results.json and OUT/table.md (OUT = --out, default runs/paillier-bench);
finished simulations under OUT/runs are reused.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulations.common import parse_overrides  # noqa: E402

from fedind.paillier import keys, packing  # noqa: E402
from fedind.config import RunConfig, recipe  # noqa: E402
from fedind.data.sources import site_from_partition  # noqa: E402
from fedind.server.metering import payload_bytes  # noqa: E402
from fedind.models import FaultCNN  # noqa: E402
from fedind.simulation import simulate  # noqa: E402
from fedind.training import cosine_lr, train_local  # noqa: E402


def real_deltas(config: RunConfig) -> list[np.ndarray]:
    """One round of local training at each site from the same initial model (flattened,
    sorted names, as the site mod sends it)."""
    torch.manual_seed(config.seed)
    model = FaultCNN(in_channels=1, num_classes=10, width=config.model_width)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    deltas = []
    for site in range(config.num_sites):
        data = site_from_partition(config.federation_spec(), "", site, config.num_sites)
        local = FaultCNN.from_state_dict(start)
        torch.manual_seed(config.seed + site)
        train_local(local, data.train, epochs=config.local_epochs, batch_size=config.batch_size,
                    lr=cosine_lr(config.learning_rate, 0.0), seed=config.seed + site, device=torch.device("cpu"),
                    momentum=config.local_momentum)
        after = local.state_dict()
        deltas.append(np.concatenate([(after[k] - start[k]).numpy().astype(np.float64).ravel() for k in sorted(start)]))
    return deltas


def cpu(fn, *args):
    started = time.process_time()
    out = fn(*args)
    return out, time.process_time() - started


def naive(key: keys.PrivateKey, deltas: list[np.ndarray], weights: np.ndarray, sample: int) -> dict:
    """phe per value, on the first ``sample`` parameters of every site; seconds per parameter."""
    pub, priv = key.phe.public_key, key.phe
    values = [d[:sample] for d in deltas]
    encrypted, t_enc = cpu(lambda: [[pub.encrypt(float(x)) for x in v] for v in values])
    started = time.process_time()
    sums = [sum(float(w) * site[j] for w, site in zip(weights, encrypted)) for j in range(sample)]
    t_agg = time.process_time() - started
    decrypted, t_dec = cpu(lambda: [priv.decrypt(s) for s in sums])
    oracle = np.average(np.stack(values), axis=0, weights=weights)
    sites = len(deltas)
    return {
        "sample_parameters": sample,
        "encrypt_s_per_param": t_enc / (sample * sites),
        "aggregate_s_per_param_per_site": t_agg / (sample * sites),
        "decrypt_s_per_param": t_dec / sample,
        "ciphertext_bytes_per_param": pub.n.bit_length() * 2 // 8,
        "max_abs_error": float(np.max(np.abs(np.array(decrypted) - oracle))),
    }


def packed(key: keys.PrivateKey, deltas: list[np.ndarray], weights: np.ndarray, clip: float,
           layout: packing.Layout = packing.FINE) -> dict:
    from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

    count, sites = deltas[0].size, len(deltas)
    rng = np.random.default_rng(0)  # the rounding draws: seeded, so a rerun repeats
    levels = [packing.quantise(d, clip, rng, layout=layout) for d in deltas]
    clipped = sum(c for _, c in levels)
    vectors, t_enc = cpu(lambda: [packing.encrypt_levels(lv, key, clip, layout=layout) for lv, _ in levels])
    # the same with obfuscators drawn ahead (as the site does while it trains)
    n_ct = layout.num_ciphertexts(key.public, count)
    pool = packing.ObfuscatorPool(key)
    _, t_obf = cpu(pool.fill, n_ct)
    _, t_enc_pre = cpu(lambda: packing.encrypt_levels(levels[0][0], key, clip, pool, layout=layout))
    parallel = packing.ObfuscatorPool(key, workers=2)
    started = time.perf_counter()
    parallel.fill(n_ct)
    wall_obf_2 = time.perf_counter() - started
    records = [v.to_config(key.public) for v in vectors]
    _, t_parse = cpu(lambda: [packing.parse_record(r, key.public, kind="update", count=count, clip=clip,
                                                   layout=layout) for r in records])
    integers = packing.integer_weights(weights, layout.max_weight)
    aggregate, t_agg = cpu(packing.weighted_sum, vectors, integers, key.public)
    mean, t_dec = cpu(packing.decrypt_sum, aggregate, key)
    phe_plain, t_dec_phe = cpu(lambda: [int(key.phe.raw_decrypt(c)) for c in aggregate.ciphertexts])
    if phe_plain != key.decrypt_many(aggregate.ciphertexts):
        raise RuntimeError("short-exponent decryption differs from phe's")
    oracle = np.average(np.stack([np.clip(d, -clip, clip) for d in deltas]), axis=0, weights=integers)
    exact = np.average(np.stack(deltas), axis=0, weights=weights)
    float32 = ArrayRecord({"delta": Array(deltas[0].astype(np.float32))})
    return {
        "parameters": count,
        "ciphertexts_per_site": n_ct,
        "values_per_ciphertext": layout.slots(key.public),
        "slot_bits": layout.slot_bits,
        "value_bits": layout.value_bits,
        "weight_bits": layout.weight_bits,
        "encrypt_s_per_site": t_enc / sites,
        "obfuscators_s_per_site": t_obf,
        "encrypt_precomputed_s_per_site": t_enc_pre,
        "obfuscators_2_processes_wall_s_per_site": wall_obf_2,
        "validate_s_per_site": t_parse / sites,
        "aggregate_s_per_site": t_agg / sites,
        "decrypt_s_per_round": t_dec,
        "decrypt_phe_crt_s_per_round": t_dec_phe,
        "short_exponent_key": key.short_exponents,
        "ciphertext_bytes": len(records[0]["ciphertexts"]),
        "float32_bytes": 4 * count,
        "record_bytes": payload_bytes(RecordDict({"encrypted-update": ConfigRecord(records[0])})),
        "float32_record_bytes": payload_bytes(RecordDict({"arrays": float32})),
        "clip": clip,
        "clipped_values": int(clipped),
        "max_abs_delta": float(max(np.abs(d).max() for d in deltas)),
        "quantisation_bound": packing.quantisation_bound(clip, layout),
        "max_abs_error_vs_clipped_mean": float(np.max(np.abs(mean.astype(np.float64) - oracle))),
        "max_abs_error_vs_float_mean": float(np.max(np.abs(mean.astype(np.float64) - exact))),
        "mean_error_vs_clipped_mean": float(np.mean(mean.astype(np.float64) - oracle)),
        "rms_error_vs_clipped_mean": float(np.sqrt(np.mean((mean.astype(np.float64) - oracle) ** 2))),
        "integer_weights": integers,
    }


# One phase (no replay, EWC or calibration: this benchmark times the rounds' updates), in both
# arms, and a dense uplink and downlink (it times whole updates).
ENCRYPTABLE = [f"{key}={str(value).lower()}" for key, value in recipe().phases_off().items()] + [
    "compression=none", "downlink=none"]

# Simulation variants: run-config overrides over the benchmark's base config.
VARIANTS = {
    "dwa": {},  # pyproject defaults: restarting server momentum (dwa-momentum) over DWA weights
    "dwa-no-server-momentum": {"dwa_momentum": 0.0, "conflict_buffer": False},  # DWA weights only
}


@contextlib.contextmanager
def encrypted_rounding():
    """Control: PLAINTEXT DWA with exactly the encrypted path's two roundings — site weights
    to multiples of 1/K (packing.integer_weights) and every site delta clipped and put on the
    fixed-point grid — so that it should track the encrypted run (diagnostic only)."""
    import fedind.server.dwa as strategy_module

    exact_weights, exact_valid = strategy_module.dwa_weights, strategy_module.DWA._valid_updates
    rng = np.random.default_rng(0)
    layout = strategy_module.DWA.encrypted_rounding_layout
    q, k = layout.value_max, layout.max_weight

    def rounded_weights(*args, **kwargs):
        return np.array(packing.integer_weights(exact_weights(*args, **kwargs), k), dtype=np.float64) / k

    def fixed_point_updates(self, server_round, replies, current):
        updates = exact_valid(self, server_round, replies, current)
        clip = self.encrypted_rounding_clip
        for u in updates:
            for name in u.arrays:
                d = np.clip(u.arrays[name].astype(np.float64) - current[name].astype(np.float64), -clip, clip)
                d = np.floor(d * (q / clip) + rng.random(d.shape)) * (clip / q)
                u.arrays[name] = (current[name].astype(np.float64) + d).astype(current[name].dtype)
        return updates

    strategy_module.dwa_weights, strategy_module.DWA._valid_updates = rounded_weights, fixed_point_updates
    try:
        yield
    finally:
        strategy_module.dwa_weights, strategy_module.DWA._valid_updates = exact_weights, exact_valid


def simulations(base: RunConfig, out: Path, variants: list[str], control: bool) -> dict:
    results = {}
    for variant in variants:
        config = replace(base, **VARIANTS[variant])
        modes = ["none", "paillier"] + (["control"] if control and config.strategy == "dwa" else [])
        results[variant] = {"overrides": {k.replace("_", "-"): v for k, v in VARIANTS[variant].items()}}
        for mode in modes:
            name = f"{variant}-{mode}"
            encryption = "paillier" if mode == "paillier" else "none"
            run = replace(config, encryption=encryption, run_dir=str(out / "runs"), run_name=name)
            folder = out / "runs" / name
            if not (folder / "summary.json").exists():
                if mode == "control":
                    import fedind.server.dwa as strategy_module

                    strategy_module.DWA.encrypted_rounding_clip = config.paillier_clip
                    strategy_module.DWA.encrypted_rounding_layout = packing.Layout.of(config)
                    with encrypted_rounding():
                        simulate(run)
                else:
                    simulate(run)
            summary = json.loads((folder / "summary.json").read_text())
            with open(folder / "rounds.csv", newline="") as f:
                accuracies = [float(row["accuracy"]) for row in csv.DictReader(f)]
            rounds = summary["rounds"]
            results[variant][mode] = {
                "final_accuracy": summary["final_accuracy"],
                "best_accuracy": summary["best_accuracy"],
                "mean_accuracy_last_5_rounds": float(np.mean(accuracies[-5:])),
                "uplink_bytes_per_round": summary["totals"]["uplink_bytes"] / rounds,
                "downlink_bytes_per_round": summary["totals"]["downlink_bytes"] / rounds,
                "seconds": summary["totals"]["seconds"],
                "failures": summary["totals"]["failures"],
            }
        plain, enc = results[variant]["none"], results[variant]["paillier"]
        results[variant]["final_accuracy_gap_points"] = 100 * (enc["final_accuracy"] - plain["final_accuracy"])
    return results


def table(r: dict) -> str:
    nv, pk, n = r["naive"], r["packed"], r["packed"]["parameters"]
    sim, sites = r["simulation"], r["config"]["num-sites"]
    naive_enc = nv["encrypt_s_per_param"] * n
    naive_agg = nv["aggregate_s_per_param_per_site"] * n
    naive_dec = nv["decrypt_s_per_param"] * n
    rows = [
        ("encrypt, s per site per round", f"{naive_enc:,.1f}", f"{pk['encrypt_s_per_site']:.2f}",
         f"{naive_enc / pk['encrypt_s_per_site']:,.0f}×"),
        ("  of which after training (obfuscators drawn while training)", "", f"{pk['encrypt_precomputed_s_per_site']:.3f}",
         f"{naive_enc / pk['encrypt_precomputed_s_per_site']:,.0f}×"),
        ("  obfuscators in 2 processes (wall)", "", f"{pk['obfuscators_2_processes_wall_s_per_site']:.2f}", ""),
        ("aggregate (server), s per site per round", f"{naive_agg:,.1f}", f"{pk['aggregate_s_per_site']:.3f}",
         f"{naive_agg / pk['aggregate_s_per_site']:,.0f}×"),
        ("validate (server), s per site per round", "", f"{pk['validate_s_per_site']:.3f}", ""),
        ("decrypt the sum (one site), s per round", f"{naive_dec:,.1f}", f"{pk['decrypt_s_per_round']:.2f}",
         f"{naive_dec / pk['decrypt_s_per_round']:,.0f}×"),
        ("  the same ciphertexts by phe's CRT decryption (exponent p - 1)", "", f"{pk['decrypt_phe_crt_s_per_round']:.2f}",
         f"{naive_dec / pk['decrypt_phe_crt_s_per_round']:,.0f}×"),
        ("ciphertext bytes per site / float32 bytes", f"{nv['ciphertext_bytes_per_param'] / 4:,.0f}×",
         f"{pk['ciphertext_bytes'] / pk['float32_bytes']:.3f}× ({pk['ciphertext_bytes']:,} B)", ""),
        ("  serialized Flower record / float32 ArrayRecord", "",
         f"{pk['record_bytes'] / pk['float32_record_bytes']:.3f}×", ""),
    ]
    lines = [
        f"{r['key_bits']}-bit key; FaultCNN update of {n:,} parameters; {sites} sites; single-core CPU seconds "
        f"(naive: {nv['sample_parameters']} parameters per site timed, extrapolated to {n:,}).",
        "",
        "| per site per round | phe per value (naive) | fedind packed | speed-up |",
        "|---|---|---|---|",
        *[f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows],
        "",
        f"Decrypted aggregate vs plaintext weighted mean of the clipped updates: max error "
        f"{pk['max_abs_error_vs_clipped_mean']:.2e} (bound clip/Q = {pk['quantisation_bound']:.2e}, stochastic rounding; clip "
        f"{pk['clip']}; largest |delta| {pk['max_abs_delta']:.3f}, {pk['clipped_values']} values clipped); "
        f"mean error {pk['mean_error_vs_clipped_mean']:.1e}, RMS {pk['rms_error_vs_clipped_mean']:.1e}.",
        "",
        f"| simulation ({r['config']['num-sites']} sites, {r['config']['num-server-rounds']} rounds) | final accuracy "
        f"| mean of last 5 rounds | best | uplink / round | downlink / round | run time |",
        "|---|---|---|---|---|---|---|",
    ]
    label = {"none": "plaintext", "paillier": f"Paillier ({r['key_bits']}-bit)",
             "control": "plaintext with the encrypted path's rounding (control)"}
    for variant, runs in sim.items():
        for mode in ("none", "paillier", "control"):
            if mode not in runs:
                continue
            s = runs[mode]
            lines.append(
                f"| {variant}: {label[mode]} | {s['final_accuracy']:.4f} | {s['mean_accuracy_last_5_rounds']:.4f} | "
                f"{s['best_accuracy']:.4f} | {s['uplink_bytes_per_round'] / 1e3:,.1f} kB | "
                f"{s['downlink_bytes_per_round'] / 1e3:,.1f} kB | {s['seconds']:.0f} s |"
            )
    if r.get("other_layouts"):
        lines += ["", layout_row_header(r["packed"]), *layout_rows(r["packed"], *r["other_layouts"])]
    return "\n".join(lines) + "\n"


def layout_row_header(pk: dict) -> str:
    return (f"The packing layouts side by side (the same updates and key; the first is this run's, "
            f"{pk['slot_bits']}-bit slots):\n\n"
            "| layout | values per ciphertext | ciphertext / float32 bytes | encrypt s per site | aggregate s per site "
            "| decrypt s per round | max error (bound) | RMS error |\n|---|---|---|---|---|---|---|---|")


def layout_rows(*runs: dict) -> list[str]:
    return [
        f"| {pk['slot_bits']}-bit slots: {pk['value_bits']} value bits (Q = {2 ** pk['value_bits'] - 1}), {pk['weight_bits']} weight bits, clip {pk['clip']} "
        f"| {pk['values_per_ciphertext']} | {pk['ciphertext_bytes'] / pk['float32_bytes']:.3f}× "
        f"| {pk['encrypt_s_per_site']:.2f} | {pk['aggregate_s_per_site']:.3f} | {pk['decrypt_s_per_round']:.2f} "
        f"| {pk['max_abs_error_vs_clipped_mean']:.2e} ({pk['quantisation_bound']:.2e}) "
        f"| {pk['rms_error_vs_clipped_mean']:.1e} |"
        for pk in runs
    ]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sites", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--sample", type=int, default=200, help="parameters per site timed for the naive baseline")
    parser.add_argument("--bits", type=int, default=2048)
    parser.add_argument("--out", default="runs/paillier-bench")
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--no-control", action="store_true", help="skip the plaintext-with-rounding control runs")
    parser.add_argument("--also-layouts", nargs="*", default=[], metavar="V/W[/CLIP]",
                        help="more packing layouts timed on the same updates, as value-bits/weight-bits and "
                             "optionally their paillier-clip (e.g. 3/7/0.1)")
    args, overrides = parser.parse_known_args(argv)
    base = parse_overrides(["strategy=dwa", f"num-sites={args.sites}", f"num-server-rounds={args.rounds}",
                            f"paillier-key-bits={args.bits}", "device=cpu", *ENCRYPTABLE, *overrides])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    deltas = real_deltas(base)
    n = np.array([site_from_partition(base.federation_spec(), "", i, base.num_sites).train.num_examples
                  for i in range(base.num_sites)], dtype=np.float64)
    weights = n / n.sum()
    key, t_key = cpu(keys.generate_keypair, args.bits)
    results = {
        "config": base.to_flower(),
        "key_bits": key.public.bits,
        "keygen_s": t_key,
        "machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print(f"{len(deltas)} real updates of {deltas[0].size} parameters; timing the packed path ...", flush=True)
    results["packed"] = packed(key, deltas, weights, base.paillier_clip, packing.Layout.of(base))
    results["other_layouts"] = []
    for spec in args.also_layouts:
        value_bits, weight_bits, *clip = spec.split("/")
        layout = packing.Layout(int(value_bits), int(weight_bits))
        results["other_layouts"].append(
            packed(key, deltas, weights, float(clip[0]) if clip else base.paillier_clip, layout))
    print(f"timing phe per value on {args.sample} parameters per site ...", flush=True)
    results["naive"] = naive(key, deltas, weights, args.sample)
    results["speedup_encrypt_per_param"] = (
        results["naive"]["encrypt_s_per_param"] * results["packed"]["parameters"] / results["packed"]["encrypt_s_per_site"]
    )
    print("simulations: plaintext vs encrypted ...", flush=True)
    results["simulation"] = simulations(base, out, args.variants, control=not args.no_control)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    text = table(results)
    (out / "table.md").write_text(text)
    print(text)
    print(f"wrote {out / 'results.json'} and {out / 'table.md'}")


if __name__ == "__main__":
    main(sys.argv[1:])
