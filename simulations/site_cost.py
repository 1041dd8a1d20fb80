"""A site agent's per-message cost, stage by stage: before (a git commit) and after (this checkout).

Flower 1.42 starts one ``flwr-clientapp`` process per message, so everything from process
start to the first training step is paid every round. Each sample here is such a fresh
process (this file with ``--child``, fedind imported from the tree under test), timed from
just before the parent starts it:

    interpreter       until the child's first line runs
    flwr imports      what ``flwr-clientapp`` imports before it loads an app
    app import        ``import fedind.site.app``
    data load         the site's data folder (``load_site_data``)
    model build       the global model from the message (``receive_model``)
    local score       the received model on the site's test split (``evaluate_known``)
    conditioning      the front end on the training windows (computed, or the site's cache)
    other             the rest until the first training step (e.g. optimiser set-up)
    → first step      process start until the first step's backward pass begins
    message done      the reply is built (site agent's mods included)
    process end       the process has exited (interpreter shutdown included)

The message is a round-1 train message with the pyproject's run config (model-width 32,
1 local epoch, as ``simulations/deployment_load.py``), through the whole ClientApp (mods
included), with ``data-dir`` and ``state-dir`` in the node config. Before and after
alternate, after one unmeasured warm-up each (which also fills the after-tree's cache).

    python simulations/site_cost.py                          # --baseline 2ba926a --repeats 5
    python simulations/site_cost.py --baseline main --repeats 9

Writes ``--out``/results.json and results.md; the stage functions are wrapped with timers
in the child (they run as always).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = ("interpreter", "flwr imports", "app import", "data load", "model build", "local score", "conditioning", "other")
MARKS = ("first step", "message done", "process end")


# --------------------------------------------------------------------------- child: one message


def _child(args: argparse.Namespace) -> None:
    """One train message in this fresh process; prints {stage: seconds} as JSON."""
    marks = {"interpreter": time.time() - args.t0}
    cpu0 = time.process_time()
    spent: dict[str, float] = {}

    def lap(name: str, since: float) -> None:
        marks[name] = time.time() - args.t0 - since

    start = time.time() - args.t0
    import flwr.supernode.runtime.run_clientapp  # noqa: F401  (flwr-clientapp's own imports)

    lap("flwr imports", start)
    start = time.time() - args.t0
    import fedind
    import fedind.site.app as agent
    from fedind import training

    lap("app import", start)
    if not Path(fedind.__file__).resolve().is_relative_to(Path(args.tree).resolve()):
        raise SystemExit(f"fedind came from {fedind.__file__}, not from {args.tree}")
    import torch

    def timed(module, name: str, stage: str) -> None:
        inner = getattr(module, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[stage] = spent.get(stage, 0.0) + time.perf_counter() - t

        setattr(module, name, wrapper)

    timed(agent, "load_site_data", "data load")
    timed(agent, "receive_model", "model build")
    timed(agent, "evaluate_known", "local score")
    timed(training, "_split_front_end", "conditioning")
    if hasattr(agent, "cached_conditioning"):
        timed(agent, "cached_conditioning", "conditioning")
    backward = torch.Tensor.backward

    def first_backward(self, *a, **k):
        marks.setdefault("first step", time.time() - args.t0)
        return backward(self, *a, **k)

    torch.Tensor.backward = first_backward
    handler_start = time.time() - args.t0
    agent.app(_message(args), _context(args))
    marks["message done"] = time.time() - args.t0
    marks.update(spent)
    marks["other"] = marks["first step"] - handler_start - sum(spent.get(s, 0.0) for s in STAGES[3:7])
    marks["cpu to message done"] = time.process_time() - cpu0
    print("SITE_COST " + json.dumps(marks), flush=True)


def _run_config() -> dict:
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    static = {"phases": 1, "phase-rounds": 0, "replay-samples": 0, "ewc-lambda": 0.0}  # as deployment_load.py
    return config | static | {"model-width": 32, "local-epochs": 1, "run-name": "site-cost"}


def _message(args: argparse.Namespace):
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedind import wire
    from fedind.config import RunConfig
    from fedind.models import initial_state

    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = 1, 7, 1  # what flwr-clientapp sets
    config = RunConfig.from_flower(_run_config())
    state = initial_state(config.seed, 1, 10, config.model_width)
    content = RecordDict({
        wire.ARRAYS: ArrayRecord({k: torch.from_numpy(v) for k, v in state.items()}),
        wire.CONFIG: ConfigRecord({wire.RUN_CONFIG: json.dumps(config.to_flower()), wire.SERVER_ROUND: 1}),
    })
    return Message(content, message_type=MessageType.TRAIN, dst_node_id=7)


def _context(args: argparse.Namespace):
    from flwr.app import Context, RecordDict

    node = {"data-dir": args.site, "state-dir": args.state}
    return Context(run_id=1, node_id=7, node_config=node, state=RecordDict(), run_config={})


# --------------------------------------------------------------------------- parent


def sample(tree: Path, site: Path, state: Path) -> dict:
    """One fresh process of ``tree``'s site agent answering one train message."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    t0 = time.time()
    done = subprocess.run(
        [sys.executable, __file__, "--child", "--tree", str(tree), "--site", str(site), "--state", str(state),
         "--t0", repr(t0)],
        capture_output=True, text=True, env=env, cwd=tree, timeout=600,
    )
    end = time.time() - t0
    line = next((x for x in done.stdout.splitlines() if x.startswith("SITE_COST ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"site agent of {tree} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(line.removeprefix("SITE_COST ")) | {"process end": end}


def export_commit(ref: str, folder: Path) -> Path:
    """The tracked files of git commit ``ref`` of this checkout, in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def median_of(samples: list[dict]) -> dict:
    return {k: statistics.median(s.get(k, 0.0) for s in samples) for k in (*STAGES, *MARKS, "cpu to message done")}


def markdown(summary: dict, args: argparse.Namespace) -> str:
    before, after = summary["before"], summary["after"]
    lines = [
        f"Median of {args.repeats} fresh processes each; one round-1 train message, {args.samples_per_site} windows "
        f"of {args.window} samples, model-width 32, 1 local epoch; {os.cpu_count()} CPU cores.",
        "",
        f"| stage | before ({args.baseline}) | after | after / before |",
        "|---|---|---|---|",
    ]
    for key in (*STAGES, *MARKS, "cpu to message done"):
        b, a = before[key], after[key]
        ratio = f"{a / b:.0%}" if b > 0.005 else ""
        name = f"**{key}**" if key == "first step" else key
        lines.append(f"| {name} | {b:.3f} s | {a:.3f} s | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="2ba926a", help="git commit of the 'before' code")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--samples-per-site", type=int, default=40)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=Path("runs/site-cost"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("--site", help=argparse.SUPPRESS)
    parser.add_argument("--state", help=argparse.SUPPRESS)
    parser.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args)
    with tempfile.TemporaryDirectory(prefix="fedind-site-cost-") as tmp:
        work = Path(tmp)
        trees = {"before": export_commit(args.baseline, work / "before"), "after": REPO}
        subprocess.run(
            [sys.executable, "-m", "fedind", "data", "generate", "--out", str(work / "data"), "--sites", "1",
             "--samples-per-site", str(args.samples_per_site), "--window", str(args.window), "--alpha", "1.0",
             "--seed", "1"],
            check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=str(REPO)),
        )
        site = next((work / "data" / "sites").iterdir())
        samples: dict[str, list[dict]] = {"before": [], "after": []}
        for i in range(args.repeats + 1):  # round 0: warm-up (page cache, .pyc, the after-tree's cache)
            for name, tree in trees.items():
                s = sample(tree, site, work / f"state-{name}")
                if i:
                    samples[name].append(s)
                print(f"{name:6s} #{i}: first step {s['first step']:.2f} s, process end {s['process end']:.2f} s"
                      f"{' (warm-up)' if not i else ''}", flush=True)
    summary = {name: median_of(s) for name, s in samples.items()}
    summary["first_step_ratio"] = summary["after"]["first step"] / summary["before"]["first step"]
    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("child", "tree", "site", "state", "t0")}
    (args.out / "results.json").write_text(json.dumps({"config": config, "summary": summary, "samples": samples}, indent=2))
    table = markdown(summary, args)
    (args.out / "results.md").write_text(table)
    print(table)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
