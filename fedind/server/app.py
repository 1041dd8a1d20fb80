"""The server: run the configured strategy over the sites, evaluate, write the results folder."""

from __future__ import annotations

import json
import random
import shutil
import time
from dataclasses import asdict
from logging import ERROR, INFO, WARNING
from pathlib import Path

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from .. import wire
from ..records import numpy_arrays
from .checkpoint import Checkpoint, CheckpointStore
from ..config import ConfigError, RunConfig
from .continual import PhaseController
from ..data.drift import phase_classes
from ..data.format import SiteArrays, validate_phases
from ..data.sources import check_data_root, global_test_set, phase_test_set, resolve_root
from ..data.synthetic import NUM_CLASSES
from .diagnostics import FeatureLog, common_cause, failure_line, inferred_classes_warning, site_score
from ..continual.expansion import head_classes
from .metering import MeteredGrid, SiteReply, Traffic
from .monitoring import RunMonitor, code_version
from ..models import FaultCNN
from .pipeline import ReplyPipeline
from .screening import UpdateScreen
from .serving import ServedModel
from .results import RoundRow, RunRecorder, best_round, finite_or_none, package_versions, rounds_to_target, save_model
from .rounds import run_rounds
from .strategies import build_strategy, load_strategy_state, strategy_state
from ..training import evaluate, pick_device
from .encrypted import encrypted_server
from ..topk.downlink import CompressedDownlink, digest
from ..topk.uplink import EstimateUplink, RoundBudget, TopkUplink

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    try:
        run_server(grid, RunConfig.from_flower(context.run_config))
    except Exception as err:
        # One line with the cause: under `flwr run` it is otherwise deep in a traceback.
        log(ERROR, "fedind: the run failed: %s", failure_line(err))
        raise


def federation_shape(config: RunConfig) -> tuple[int, int, tuple[int, int]]:
    """(number of sites, classes, [C, L]) — validating data-root before any round (with
    phases, every phase's batches). With phases, the classes are those of phase 0."""
    if config.data_root:
        info = check_data_root(config.data_root)
        if warning := inferred_classes_warning(info):
            log(WARNING, "data-root %s: %s", config.data_root, warning)
        if config.phases > 1:
            validate_phases(resolve_root(config.data_root), config.phases)
        return len(info["sites"]), int(info["num_classes"]), tuple(info["sample_shape"])
    spec = config.federation_spec()
    classes = phase_classes(config.drift_spec(), 0) if config.phases > 1 else NUM_CLASSES
    return spec.num_sites, classes, (1, spec.window)


def wait_for_sites(grid: Grid, expected: int, timeout: float) -> list[int]:
    """Block until ``expected`` SuperNodes are connected; a different count is an error."""
    deadline = time.monotonic() + timeout
    while len(nodes := list(grid.get_node_ids())) < expected and time.monotonic() < deadline:
        time.sleep(0.5)
    if len(nodes) != expected:
        raise ConfigError(
            f"the federation has {expected} sites but {len(nodes)} SuperNodes are connected; "
            f"in simulation run with --federation-config 'num-supernodes={expected}'"
        )
    return sorted(nodes)


def run_server(grid: Grid, config: RunConfig) -> dict:
    num_sites, num_classes, (channels, _) = federation_shape(config)
    folder = run_folder(config)
    store = CheckpointStore(folder / "checkpoints", keep=config.checkpoint_keep)
    # Before anything is written or waited for: results are never overwritten unasked.
    checkpoint = resume_point(store, config) if config.resume else None
    if checkpoint is None:
        claim_run_folder(folder, config)
    # With phases the controller scores each phase's test set instead (fedind.continual.phases).
    test_set = global_test_set(config.federation_spec(), config.data_root) if config.phases == 1 else None
    if config.phases == 1 and test_set is None:
        log(WARNING, "no global test set (%s has no test.npz): the server does not score the global model "
            "(accuracy nan in rounds.csv); the summary has per-site scores only", config.data_root)
    node_ids = wait_for_sites(grid, num_sites, timeout=60.0)
    device = pick_device(config.device)
    torch.manual_seed(config.seed)
    random.seed(config.seed)  # Flower's strategies sample sites with `random`
    model = FaultCNN(in_channels=channels, num_classes=num_classes, width=config.model_width)
    initial = ArrayRecord(model.state_dict())
    initial_classes = num_classes
    if checkpoint is not None and config.phases > 1:  # the head may have grown before the checkpoint
        num_classes = head_classes(checkpoint.arrays)
    # Plaintext updates are screened before the strategy sees them (fedind.server.screening);
    # under encryption there is nothing the server could read to screen.
    rules = config.screen_rules
    screen = None
    if config.encryption == "paillier":  # the server holds the public key only (fedind.server.encrypted)
        strategy, pipeline = encrypted_server(config, num_sites, num_classes)
        transform = None  # nothing to decode in the clear: the pipeline parses the ciphertexts
    else:
        strategy = build_strategy(config, num_sites, num_classes)
        ef21 = config.compression == "topk" and config.topk_feedback == "estimate"
        schedule = RoundBudget(config.topk_ratio, config.topk_warmup_rounds)
        transform = (EstimateUplink(config.topk_estimate_decay, schedule) if ef21
                     else TopkUplink(config.topk_gain, schedule))
        screen = UpdateScreen(num_classes, **rules)
        pipeline = ReplyPipeline(uplink=transform, screen=screen)  # each reply decoded once, then screened
    if config.downlink == "topk":  # sites mirror a broadcast model moved by sparse steps
        # The sites' updates are deltas from that copy, plaintext or encrypted alike: the
        # strategy (SecureAggregation: its decrypted mean) adds them to its own global model.
        spec = {"seed": config.seed, "in_channels": channels, "num_classes": num_classes, "width": config.model_width}
        own = None if checkpoint is not None else (digest(numpy_arrays(initial)), spec)
        inner = transform if transform is not None else TopkUplink()  # encrypted: an uplink that passes replies on
        transform = CompressedDownlink(inner, config.downlink_ratio, config.downlink_quantization, own,
                                       config.downlink_momentum)
    saved = checkpoint.state if checkpoint else {}
    recorder = RunRecorder(
        folder, [RoundRow(**row) for row in saved.get("rows", [])], saved.get("initial_accuracy")
    )
    monitor = RunMonitor.start(config, folder.name, num_sites)  # Prometheus, if metrics-port > 0
    metered = MeteredGrid(grid, transform=transform, screen=pipeline)
    # A plain Flower ClientApp works too; say once which fedind features its replies switch off.
    features = FeatureLog(config.strategy if config.dwa_weighting else "",
                          alignment_on=screen is not None and rules["alignment_threshold"] is not None)
    last_failures: list[str] = []  # of the latest round that had any: the cause a failed run reports
    clock = {"round": time.monotonic(), "checkpoint": time.monotonic()}
    site_cpu = {"site_train_cpu_seconds": 0.0, "site_compress_cpu_seconds": 0.0, **saved.get("site_cpu", {})}
    run_config_json = json.dumps(config.to_flower())
    continual = None
    if config.phases > 1:
        continual = PhaseController(
            config,
            strategy=strategy,
            grid=metered,
            node_ids=node_ids,
            num_classes=num_classes,
            initial_classes=initial_classes,
            test_sets=[phase_test_set(config.drift_spec(), config.data_root, p) for p in range(config.phases)],
            device=device,
            folder=folder,
            run_config_json=run_config_json,
            pipeline=pipeline,
            secure=strategy if config.encryption == "paillier" else None,
        )
    served = ServedModel(config.served_ema)  # what is scored and published (fedind.server.serving)
    arrays, first_round = initial, 1
    if checkpoint is not None:
        arrays, first_round = restore_server(checkpoint, strategy, continual, served), checkpoint.round + 1
        if screen is not None and "screen" in checkpoint.state:
            screen.load_state_dict(checkpoint.state["screen"])
        log(INFO, "resuming run %s at round %d from %s", folder.name, first_round, checkpoint.path)
    started = time.monotonic() - float(saved.get("elapsed_seconds", 0.0))

    def evaluate_round(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        if continual is not None:
            accuracy, loss = continual.score(server_round, arrays)
        else:
            accuracy, loss = _score(arrays, test_set, device)
        traffic = metered.take()
        if server_round == 0:
            recorder.initial_accuracy = accuracy
        else:
            row = _round_row(server_round, accuracy, loss, traffic, time.monotonic() - clock["round"])
            for reply in traffic.replies:
                site_cpu["site_train_cpu_seconds"] += float(reply.metrics.get(wire.TRAIN_SECONDS, 0.0))
                site_cpu["site_compress_cpu_seconds"] += float(reply.metrics.get(wire.COMPRESS_SECONDS, 0.0))
                peak = float(reply.metrics.get(wire.PEAK_RSS_MB, 0.0))
                site_cpu["site_peak_rss_mb"] = max(site_cpu.get("site_peak_rss_mb", 0.0), peak)
            features.note(r for r in traffic.replies if r.message_type == MessageType.TRAIN)
            recorder.add(row)
            monitor.record_round(row)
            log(
                INFO,
                "round %d/%d  accuracy %.4f  loss %.4f  sites %d  failed %d  up %.2f MB  down %.2f MB  %.1f s",
                server_round, config.num_server_rounds, accuracy, loss, row.sites, row.failures,
                row.uplink_bytes / 1e6, row.downlink_bytes / 1e6, row.seconds,
            )
            for failure in traffic.failures:
                log(WARNING, "  failed: %s", failure)
            if traffic.failures:
                last_failures[:] = traffic.failures
            if row.sites == 0:
                log(WARNING, "round %d: no site update arrived; the global model is unchanged (cause: %s)",
                    server_round, common_cause(traffic.failures) or "no site was sampled")
        clock["round"] = time.monotonic()
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    def publish(server_round: int, arrays: ArrayRecord, fold: bool = True) -> ArrayRecord:
        """The model scored and published after ``server_round``: the served average of the
        global models (fedind.server.serving); after the last round, with head calibration,
        the global model with its head refit on the lines' feature moments instead. The
        calibration does for the head what the average does, and the average's body lags a
        class learnt in the last phase (new-class recall -3.8 points, docs/benchmarks/plant.md)."""
        model = served.update(arrays) if fold else served.current(arrays)
        if continual is not None and config.head_calibration and server_round == config.num_server_rounds:
            return continual.calibrate(server_round, arrays)
        return model

    def checkpoint_round(server_round: int, arrays: ArrayRecord) -> None:
        due = (config.checkpoint_interval and server_round % config.checkpoint_interval == 0) or (
            config.checkpoint_seconds and time.monotonic() - clock["checkpoint"] >= config.checkpoint_seconds
        )
        if not (due or server_round == config.num_server_rounds):
            return
        state = {
            "run_config": config.to_flower(),
            "model_keys": list(arrays.keys()),
            "strategy": strategy_state(strategy),
            "served": served.state_dict(),
            "rng": {"python": list(random.getstate()), "torch": torch.get_rng_state().numpy()},
            "rows": [asdict(row) for row in recorder.rows],
            "initial_accuracy": recorder.initial_accuracy,
            "site_cpu": dict(site_cpu),
            "elapsed_seconds": time.monotonic() - started,
        }
        if screen is not None:
            state["screen"] = screen.state_dict()  # the sites' label-alignment records
        if continual is not None:
            state["continual"] = continual.state_dict()  # EWC Fisher and anchors, classes, phase scores
        path = store.save(server_round, numpy_arrays(arrays), state)
        clock["checkpoint"] = time.monotonic()
        log(INFO, "checkpoint of round %d saved to %s", server_round, path)

    final = run_rounds(
        strategy,
        metered,
        arrays,
        first_round=first_round,
        num_rounds=config.num_server_rounds,
        timeout=config.round_timeout,
        train_config=train_config(config, run_config_json),
        evaluate_fn=evaluate_round,
        min_sites=config.min_sites,
        after_round=checkpoint_round if (config.checkpoint_interval or config.checkpoint_seconds) else None,
        train_records=continual.train_records if continual is not None else None,
        end_of_round=continual.end_of_round if continual is not None else None,
        serve=publish,
    )
    if first_round > config.num_server_rounds:  # resumed after its last round: publish again
        final = publish(config.num_server_rounds, arrays, fold=False)
    per_site, replies = evaluate_at_sites(metered, node_ids, final, run_config_json, config.round_timeout)
    if continual is not None:  # the final replies carry the replay buffers' figures with the last batch
        for reply in replies:
            continual.note_replay(reply.site_id, reply.metrics)
    summary = _finish(
        config, recorder, final, per_site, time.monotonic() - started, num_sites, site_cpu,
        continual=continual.summary() if continual is not None else None,
    )
    monitor.finish()
    monitor.close()
    log(INFO, "%s", format_summary(summary, folder))
    if not any(row.sites for row in recorder.rows):
        raise RuntimeError(
            f"no site update was aggregated in any round; cause: {common_cause(last_failures) or 'no site replied'}"
        )
    return summary


# ---------------------------------------------------------------------- resume

# Run-config keys a resumed run may change; any other difference is refused (it would not
# be the same run). A different num-server-rounds extends or shortens the run (the sites'
# cosine learning rate then follows the new length).
RESUMABLE_CHANGES = frozenset(
    {
        "resume", "run-name", "run-dir", "num-server-rounds", "round-timeout", "min-sites", "device",
        "checkpoint-interval", "checkpoint-seconds", "checkpoint-keep", "metrics-port", "metrics-address",
        "paillier-public-key", "paillier-private-key", "overwrite",
    }
)

# What a run writes into its folder; a folder holding any of the first four holds a run's
# results, which a new run (not a resume) refuses to replace unless overwrite = true.
RESULTS = ("summary.json", "rounds.csv", "model.safetensors", "checkpoints", "model.safetensors.sha256",
           "progress.png", "phases.csv")


def existing_results(folder: Path) -> list[str]:
    """The names in ``folder`` that hold a run's results (an empty checkpoints folder holds none)."""
    found = []
    for name in RESULTS[:4]:
        path = folder / name
        if path.is_file() or (path.is_dir() and any(path.iterdir())):
            found.append(name)
    return found


def claim_run_folder(folder: Path, config: RunConfig) -> None:
    """Make ``folder`` ready for a run that starts at round 1. A folder that holds a run's
    results is refused (ConfigError), unless ``overwrite``: then those results go first, so
    that a stale checkpoint of the old run can never outrank the new run's or be resumed."""
    found = existing_results(folder)
    if not found:
        return
    if not config.overwrite:
        raise ConfigError(
            f"run folder {folder} already holds a run ({', '.join(found)}); choose another run-name, "
            f"set resume = true to continue it, or overwrite = true to replace it"
        )
    log(WARNING, "overwrite = true: removing the results of the earlier run in %s", folder)
    for name in RESULTS:
        path = folder / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def train_config(config: RunConfig, run_config_json: str) -> ConfigRecord:
    """What every train message carries: fedind's run config (its agent reads everything
    from it) and the keys a Flower quickstart ClientApp reads (``lr``, ``local-epochs``;
    ``lr`` is the run's starting rate: fedind's agent decays it, a plain client keeps it)."""
    return ConfigRecord(
        {wire.RUN_CONFIG: run_config_json, wire.LR: config.learning_rate, wire.LOCAL_EPOCHS: config.local_epochs}
    )


def run_folder(config: RunConfig) -> Path:
    """run-dir/run-name; with ``resume`` and no run-name, the run there whose checkpoint is newest."""
    root = Path(config.run_dir).resolve()
    if config.run_name:
        return root / config.run_name
    if config.resume:
        runs = [c.parent for c in root.glob("*/checkpoints") if c.is_dir()]
        if runs:
            return max(runs, key=lambda run: (run / "checkpoints").stat().st_mtime)
    return root / f"{config.strategy}-{time.strftime('%Y%m%d-%H%M%S')}"


def resume_point(store: CheckpointStore, config: RunConfig) -> Checkpoint | None:
    """The newest checkpoint that verifies and belongs to this run config (ConfigError if it
    does not, or lies beyond num-server-rounds). With none, a ConfigError, unless
    ``overwrite``: then None, logged, and the run starts over at round 1."""
    checkpoint = store.load_latest()
    if checkpoint is None:
        if not config.overwrite:
            raise ConfigError(
                f"resume = true but there is nothing to resume: no valid checkpoint in {store.folder}; "
                f"set resume = false for a new run, or overwrite = true to start this one over"
            )
        log(WARNING, "resume: no valid checkpoint in %s; overwrite = true: starting over at round 1", store.folder)
        return None
    if checkpoint.round > config.num_server_rounds:
        raise ConfigError(
            f"cannot resume {checkpoint.path}: it is after round {checkpoint.round}, beyond "
            f"num-server-rounds = {config.num_server_rounds}; set num-server-rounds >= {checkpoint.round}"
        )
    saved = checkpoint.state.get("run_config", {})
    current = config.to_flower()
    changed = sorted(k for k in set(saved) | set(current) if k not in RESUMABLE_CHANGES and saved.get(k) != current.get(k))
    if changed:
        details = ", ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in changed)
        raise ConfigError(f"cannot resume {checkpoint.path}: the run config differs ({details})")
    return checkpoint


def restore_server(checkpoint: Checkpoint, strategy, continual: PhaseController | None = None,
                   served: ServedModel | None = None) -> ArrayRecord:
    """Put the strategy, the continual-learning state (EWC Fisher and anchors, classes), the
    served average and the server's random generators back as they were after
    ``checkpoint.round``; return the global arrays, in the model's key order."""
    state = checkpoint.state
    keys = state["model_keys"]
    if sorted(keys) != sorted(checkpoint.arrays):
        raise ConfigError(f"cannot resume {checkpoint.path}: model_keys do not match model.safetensors")
    load_strategy_state(strategy, state["strategy"])
    if served is not None and "served" in state:
        served.load_state_dict(state["served"])
    if continual is not None:
        if "continual" not in state:
            raise ConfigError(f"cannot resume {checkpoint.path}: it has no continual-learning state")
        continual.load_state_dict(state["continual"])
    version, internal, gauss = state["rng"]["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(torch.from_numpy(np.asarray(state["rng"]["torch"], dtype=np.uint8)))
    return ArrayRecord({name: Array(checkpoint.arrays[name]) for name in keys})


def _score(arrays: ArrayRecord, test_set: SiteArrays | None, device: torch.device) -> tuple[float, float]:
    if test_set is None:
        return float("nan"), float("nan")
    result = evaluate(FaultCNN.from_state_dict(arrays.to_torch_state_dict()), test_set, device)
    return result.accuracy, result.loss


def _round_row(server_round: int, accuracy: float, loss: float, traffic: Traffic, seconds: float) -> RoundRow:
    trained = [r for r in traffic.replies if r.message_type == MessageType.TRAIN]
    return RoundRow(
        round=server_round,
        accuracy=accuracy,
        loss=loss,
        uplink_bytes=traffic.uplink_bytes,
        downlink_bytes=traffic.downlink_bytes,
        sites=len(trained),
        failures=len(traffic.failures),
        seconds=seconds,
    )


def evaluate_at_sites(
    grid: MeteredGrid, node_ids: list[int], arrays: ArrayRecord, run_config_json: str, timeout: float
) -> tuple[dict[str, dict], list[SiteReply]]:
    """One evaluate round: every site scores the final model on its own test split (a site
    without one scores nothing; :func:`fedind.server.diagnostics.site_score` reads what each sent).
    Returns the scores per site and the replies."""
    content = RecordDict({wire.ARRAYS: arrays, wire.CONFIG: ConfigRecord({wire.RUN_CONFIG: run_config_json})})
    messages = [Message(content=content, message_type=MessageType.EVALUATE, dst_node_id=n) for n in node_ids]
    grid.send_and_receive(messages, timeout=timeout)
    traffic = grid.take()
    for failure in traffic.failures:
        log(INFO, "final evaluation failed at %s", failure)
    per_site = {r.site_id: site_score(r.metrics) for r in sorted(traffic.replies, key=lambda r: r.site_id)}
    renamed = sorted({entry["reported_as"] for entry in per_site.values() if "reported_as" in entry})
    if renamed:
        log(INFO, "final evaluation: accuracy read from the sites' %s metric", ", ".join(map(repr, renamed)))
    for site, entry in per_site.items():
        if entry["accuracy"] is None:
            log(WARNING, "final evaluation: site %s: %s", site, entry["note"])
    return per_site, traffic.replies


def _finish(
    config: RunConfig,
    recorder: RunRecorder,
    arrays: ArrayRecord,
    per_site: dict,
    seconds: float,
    num_sites: int,
    site_cpu: dict[str, float],
    continual: dict | None = None,
) -> dict:
    state = numpy_arrays(arrays)
    digest = save_model(recorder.folder / "model.safetensors", state, {"format": "fedind.FaultCNN"})
    accuracies = [r.accuracy for r in recorder.rows]
    best = best_round(accuracies)  # None when no round was scored (no global test set)
    summary = {
        "run": recorder.folder.name,
        "rounds": len(recorder.rows),
        "sites": num_sites,
        # false: no global test set, so accuracies are null and per_site is the only score
        "global_test": best is not None or finite_or_none(recorder.initial_accuracy) is not None,
        "final_accuracy": finite_or_none(accuracies[-1]) if accuracies else None,
        "best_accuracy": accuracies[best] if best is not None else None,
        "best_round": best + 1 if best is not None else None,
        "initial_accuracy": finite_or_none(recorder.initial_accuracy),
        "target_accuracy": config.target_accuracy,
        "rounds_to_target": rounds_to_target(accuracies, config.target_accuracy),
        "totals": {
            "uplink_bytes": sum(r.uplink_bytes for r in recorder.rows),
            "downlink_bytes": sum(r.downlink_bytes for r in recorder.rows),
            "failures": sum(r.failures for r in recorder.rows),
            "seconds": seconds,
            **site_cpu,
        },
        "model_parameters": int(sum(v.size for v in state.values())),
        "model_sha256": digest,
        "per_site": per_site,
        **({"continual": continual} if continual is not None else {}),
        "config": config.to_flower(),
        "versions": package_versions(),
        "code_version": code_version(),  # fedind version, git describe, source SHA-256
    }
    recorder.write_summary(summary)
    recorder.plot(f"{config.strategy}, {num_sites} sites")
    return summary


def format_summary(summary: dict, folder: Path) -> str:
    """The human-readable end of a run."""
    totals = summary["totals"]
    target = summary["rounds_to_target"]
    def score(value) -> str:
        return "-" if value is None else f"{value:.4f}"

    lines = [
        "",
        f"fedind run '{summary['run']}' finished: {summary['rounds']} rounds, {summary['sites']} sites, "
        f"{totals['seconds']:.1f} s",
        f"  global test accuracy   final {score(summary['final_accuracy'])}   best {score(summary['best_accuracy'])} "
        f"(round {summary['best_round']})   initial {score(summary['initial_accuracy'])}"
        if summary.get("global_test", True) else "  global test accuracy   none (no global test set: per-site scores only)",
        f"  target {summary['target_accuracy']:.2f}             "
        + (f"reached at round {target}" if target else "not reached"),
        f"  traffic                uplink {totals['uplink_bytes'] / 1e6:.2f} MB   downlink "
        f"{totals['downlink_bytes'] / 1e6:.2f} MB   failed replies {totals['failures']}",
        f"  model                  {summary['model_parameters']} parameters, sha256 {summary['model_sha256'][:16]}…",
        "  per-site accuracy of the final model (each site's own test split):",
    ]
    for site, info in summary["per_site"].items():
        lines.append(f"    {site:<12} {score(info['accuracy'])}  (n={info['num_examples']})"
                     + (f"  {info['note']}" if "note" in info else ""))
    lines.append(f"  results in {folder}/ : rounds.csv summary.json model.safetensors progress.png")
    return "\n".join(lines)
