"""Scale check of the deployment: N real SuperNodes against one SuperLink on loopback.

For each N in ``--sites``: a fresh plant (tests/deploy_harness.py, the deploy/ scripts as in
README's Deployment section: TLS, SuperNode authentication, registered keys), N site agents
(``flower-supernode``, each with its own data folder, state-dir and FLWR_HOME), then a real
``flwr run`` of ``--rounds`` rounds. Reports per N: time until all N are online, round
wall time (round 1 separately: the agents install the app bundle then), the server's
memory (SuperLink + SuperExec + ServerApp processes: idle before the run, peak during it)
and the site agents' memory (SuperNode + its SuperExec per agent idle; all agents with
their ClientApp processes and site workers at the peak). Memory is PSS (proportional set size: pages shared
between processes, e.g. torch's libraries, are split between them), sampled every 0.5 s.

    python simulations/deployment_load.py                      # 5, 10, 20, 25 sites, 2 rounds
    python simulations/deployment_load.py --sites 5 10 --rounds 3
    python simulations/deployment_load.py --sites 10 --baseline 2ba926a   # that commit's code, then this one's

With ``--baseline REF`` each size runs twice in the same invocation, first with the code of
git commit ``REF`` (``flwr run`` of a ``git archive`` of it: server and site agents run that
commit's fedind), then with this checkout's: before and after, side by side.

Writes ``--out``/results.json and results.md (the README table). On a 2-core machine all
agents and the server share the two cores, so the round time is mostly N ClientApp
processes starting (each imports torch) and training one after another.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the plant: tests/deploy_harness.py

from deploy_harness import BIN, LocalPlant, descendants, memory_bytes  # noqa: E402
from fedind.server.monitoring import code_version  # noqa: E402


# Static data, as on 2026-11-29: the pyproject's default now has two data phases with replay
# and EWC, which a 2-round check cannot hold (phase-rounds = 20).
STATIC = "phases=1 phase-rounds=0 replay-samples=0 ewc-lambda=0.0 head-calibration=false"


def sample_peak(pids_fn, stop: threading.Event, peak: dict) -> None:
    while not stop.is_set():
        peak["bytes"] = max(peak["bytes"], memory_bytes(pids_fn()))
        stop.wait(0.5)


def all_pids(procs, state_dirs=()) -> list[int]:
    """The agents' processes: each SuperNode with its descendants, and the site workers
    (fedind.site.worker: detached, so found by their pid files in the state dirs)."""
    pids = [pid for p in procs if p.alive() for pid in (p.popen.pid, *descendants(p.popen.pid))]
    for folder in state_dirs:
        try:
            worker = int((folder / "worker" / "worker.pid").read_text())
        except (OSError, ValueError):
            continue
        pids += [worker] if worker not in pids else []
    return pids


def export_commit(ref: str, folder: Path) -> Path:
    """The tracked files of git commit ``ref`` of this checkout, in ``folder``."""
    repo = Path(__file__).resolve().parents[1]
    folder.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", ref], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def one_size(n: int, args: argparse.Namespace, work: Path, app: Path = Path("."), label: str = "this checkout") -> dict:
    root = work / f"sites-{n}-{'before' if app != Path('.') else 'after'}"
    sites = [f"line-{i:02d}" for i in range(n)]
    with LocalPlant(root) as plant:
        plant.run([BIN / "fedind", "data", "generate", "--out", root / "data", "--sites", n,
                   "--samples-per-site", args.samples_per_site, "--window", args.window, "--alpha", args.alpha,
                   "--seed", 1])
        plant.make_keys(sites)
        plant.start_superlink()
        plant.connect_cli()
        started = time.monotonic()
        plant.register()
        registered = time.monotonic() - started
        started = time.monotonic()
        nodes = [plant.start_supernode(site, root / "data" / "sites" / site) for site in sites]
        plant.wait_for(lambda: plant.online_nodes() == n, 60 + 10 * n, f"{n} SuperNodes online", every=2)
        online = time.monotonic() - started
        time.sleep(2)
        server_idle = memory_bytes(plant.server_pids())
        agent_idle = [memory_bytes([p.popen.pid, *descendants(p.popen.pid)]) for p in nodes]

        run_config = (
            f"data-root='{root / 'data'}' run-dir='{root / 'runs'}' run-name='load' "
            f"num-server-rounds={args.rounds} local-epochs=1 model-width={args.model_width} "
            f"round-timeout=900.0 {STATIC}"
        )
        stop, peak, plant_peak = threading.Event(), {"bytes": server_idle}, {"bytes": 0}
        samplers = [
            threading.Thread(target=sample_peak, args=(plant.server_pids, stop, peak), daemon=True),
            threading.Thread(target=sample_peak, args=(lambda: all_pids(nodes, [plant.state_dir(s) for s in sites]), stop, plant_peak), daemon=True),
        ]
        for sampler in samplers:
            sampler.start()
        started = time.monotonic()
        run = plant.start("flwr-run", [BIN / "flwr", "run", app, plant.connection, "--stream", "--run-config", run_config])
        code = run.popen.wait(timeout=args.rounds * (60 + 10 * n) + 300)
        total = time.monotonic() - started
        stop.set()
        for sampler in samplers:
            sampler.join()
        if code != 0:
            raise RuntimeError(f"flwr run with {n} sites failed:\n{run.text()[-4000:]}")
        if not (root / "runs" / "load" / "rounds.csv").exists():  # flwr run exits 0 when the ServerApp fails
            raise RuntimeError(f"flwr run with {n} sites wrote no rounds:\n{run.text()[-4000:]}")
        with open(root / "runs" / "load" / "rounds.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        summary = json.loads((root / "runs" / "load" / "summary.json").read_text())
    later = [float(r["seconds"]) for r in rows[1:]] or [float(rows[0]["seconds"])]
    result = {
        "code": label,
        "sites": n,
        "register_seconds": registered,
        "online_seconds": online,
        "round1_seconds": float(rows[0]["seconds"]),
        "round_seconds_mean": sum(later) / len(later),
        "round_seconds_max": max(later),
        "run_seconds": total,
        "sites_per_round": [int(r["sites"]) for r in rows],
        "failures": sum(int(r["failures"]) for r in rows),
        "uplink_bytes_per_round": sum(int(r["uplink_bytes"]) for r in rows) / len(rows),
        "server_pss_idle_mb": server_idle / 2**20,
        "server_pss_peak_mb": peak["bytes"] / 2**20,
        "agent_pss_idle_mb_mean": sum(agent_idle) / len(agent_idle) / 2**20,
        "agents_pss_peak_mb": plant_peak["bytes"] / 2**20,  # all agents with their ClientApps, summed
        "model_parameters": summary["model_parameters"],
    }
    print(json.dumps(result), flush=True)
    return result


def markdown(results: list[dict], args: argparse.Namespace) -> str:
    lines = [
        f"{args.rounds} rounds, 1 local epoch, {args.samples_per_site} windows of {args.window} samples per site, "
        f"model-width {args.model_width} ({results[0]['model_parameters']:,} parameters), dense updates; "
        f"{os.cpu_count()} CPU cores, SuperLink and all agents on one machine, 127.0.0.1, TLS + SuperNode auth.",
        "",
        "| code | sites | all online after | round 1 | later rounds (mean / max) | sites per round | failures "
        "| server memory idle → peak | per agent (idle) | all agents (peak) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.get('code', 'this checkout')} | {r['sites']} | {r['online_seconds']:.0f} s | {r['round1_seconds']:.1f} s "
            f"| {r['round_seconds_mean']:.1f} / {r['round_seconds_max']:.1f} s "
            f"| {', '.join(map(str, r['sites_per_round']))} | {r['failures']} "
            f"| {r['server_pss_idle_mb']:.0f} → {r['server_pss_peak_mb']:.0f} MB | {r['agent_pss_idle_mb_mean']:.0f} MB "
            f"| {r['agents_pss_peak_mb'] / 1024:.1f} GB |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, nargs="+", default=[5, 10, 20, 25])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--samples-per-site", type=int, default=40)
    parser.add_argument("--alpha", type=float, default=1.0, help="label skew; small sites need a mild one")
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--model-width", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("runs/deployment-load"))
    parser.add_argument("--baseline", metavar="REF", help="also run each size with the code of git commit REF, first")
    parser.add_argument("--keep", action="store_true", help="keep the plants' folders (logs) under --out")
    args = parser.parse_args()
    # Stop cleanly (the plants' processes too) on Ctrl-C, kill and when run in the background.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "plants" if args.keep else Path(tempfile.mkdtemp(prefix="fedind-load-"))
    results = []
    try:
        baseline = export_commit(args.baseline, work / "baseline") if args.baseline else None
        for n in args.sites:
            if baseline is not None:
                results.append(one_size(n, args, work, baseline, label=f"before ({args.baseline})"))
            results.append(one_size(n, args, work))
            (args.out / "results.json").write_text(json.dumps(
                {"config": vars(args) | {"out": str(args.out)}, "code_version": code_version(), "results": results},
                indent=2,
            ))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    table = markdown(results, args)
    (args.out / "results.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
