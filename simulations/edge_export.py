"""The model for the line's computer, measured side by side: the float model, its int8
static quantisation, a distilled narrower student and the student in int8 — accuracy on
the global test set, agreement with the float model, file size, CPU latency per window on
one thread (one window per call, and per window in batches of 256).

    python simulations/edge_export.py                       # runs/edge-float, trained if missing
    python simulations/edge_export.py --run runs/NAME --student-width 8

The float model is a finished run's (``--run``: its model.safetensors, verified); without
one, the pyproject default federation is trained first (loopback simulation, CPU) into
runs/edge-float. Calibration: site 0's own training windows. Distillation: every site's
training windows (the teacher's logits and the labels). A continual run (phases > 1) is
scored on its last phase's global test set. Writes runs/edge/export.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from simulations.common import parse_overrides  # noqa: E402

from fedind.centralized import site_training_data  # noqa: E402
from fedind.config import RunConfig  # noqa: E402
from fedind.data.sources import global_test_set, phase_test_set, site_from_partition  # noqa: E402
from fedind.edge.export import (  # noqa: E402
    distil,
    latency,
    predict_classes,
    weight_bytes,
    quantize_static,
    to_torchscript,
    torchscript_bytes,
)
from fedind.edge.predict import load_model  # noqa: E402

BAR = {"accuracy_points": 1.0, "smaller": 3.0, "faster": 2.0}


def float_run(run: Path | None) -> Path:
    """The run folder of the float model: ``run``, or runs/edge-float (trained if missing)."""
    if run is not None:
        return run
    config = parse_overrides(['run-name="edge-float"', 'device="cpu"'])
    folder = Path(config.run_dir) / config.run_name
    if not (folder / "summary.json").is_file():
        from fedind.simulation import simulate

        print(f"training the float model: the default federation, loopback, into {folder}", flush=True)
        simulate(config, runtime="loopback")
    return folder


def evaluation_data(config: RunConfig):
    """(global test set, every site's training windows); a continual run's: the last
    phase's test set and every phase's site batches."""
    if config.phases == 1:
        return global_test_set(config.federation_spec(), config.data_root), site_training_data(config)
    spec = None if config.data_root else config.drift_spec()
    parts = [site_from_partition(spec, config.data_root, i, config.num_sites, p).train
             for p in range(config.phases) for i in range(config.num_sites)]
    return phase_test_set(config.drift_spec(), config.data_root, config.phases - 1), parts


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, default=None)
    parser.add_argument("--student-width", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--out", type=Path, default=Path("runs/edge/export.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    folder = float_run(args.run)
    summary = json.loads((folder / "summary.json").read_text())
    config = RunConfig.from_flower(summary["config"])
    loaded = load_model(folder)  # digests checked
    teacher = loaded.model
    test, parts = evaluation_data(config)
    calibration = parts[-config.num_sites].x  # site 0's own windows (of the last phase)
    pooled_x = np.concatenate([p.x for p in parts])
    pooled_y = np.concatenate([p.y for p in parts])
    started = time.time()
    student = distil(teacher, pooled_x, pooled_y, width=args.student_width, epochs=args.epochs, seed=config.seed)
    distil_seconds = time.time() - started
    window = test.x.shape[1:]
    plain = {
        "float": teacher,
        "float (TorchScript)": teacher,
        "int8 static": quantize_static(teacher, calibration),
        f"student w{args.student_width} float": student,
        f"student w{args.student_width} int8": quantize_static(student, calibration),
    }
    candidates = {name: m if name == "float" else to_torchscript(m, window) for name, m in plain.items()}
    float_classes = predict_classes(teacher, test.x)
    float_size = (folder / "model.safetensors").stat().st_size
    rows = {}
    for name, module in candidates.items():
        classes = predict_classes(module, test.x)
        size = float_size if name == "float" else len(torchscript_bytes(module))
        speed = latency(module, test.x)
        rows[name] = {
            "accuracy": float(np.mean(classes == test.y)),
            "agreement_with_float": float(np.mean(classes == float_classes)),
            "bytes": size,
            "weight_bytes": weight_bytes(plain[name]),
            "latency_us_single": speed.single_us,
            "latency_us_batched": speed.batched_us,
        }
    base = rows["float"]
    for row in rows.values():
        row["points_below_float"] = 100 * (base["accuracy"] - row["accuracy"])
        row["smaller"] = base["bytes"] / row["bytes"]
        row["smaller_weights"] = base["weight_bytes"] / row["weight_bytes"]
        row["faster_single"] = base["latency_us_single"] / row["latency_us_single"]
        row["faster_batched"] = base["latency_us_batched"] / row["latency_us_batched"]
        row["meets_bar"] = (row["points_below_float"] <= BAR["accuracy_points"] and row["smaller"] >= BAR["smaller"]
                            and min(row["faster_single"], row["faster_batched"]) >= BAR["faster"])
    print(f"\nfloat model: {folder} (round {loaded.round}, sha256 {loaded.sha256[:16]}…, run final accuracy "
          f"{summary['final_accuracy']:.4f}); {len(test.y)} global test windows (of phase {config.phases - 1}); "
          f"1 torch thread\n")
    header = f"{'model':<22}{'accuracy':>9}{'Δ pts':>7}{'agree':>7}{'bytes':>9}{'smaller':>8}{'weights':>8}" \
             f"{'µs/win 1':>10}{'µs/win 256':>11}{'faster 1':>9}{'faster 256':>11}  bar"
    print(header)
    for name, r in rows.items():
        print(f"{name:<22}{r['accuracy']:>9.4f}{r['points_below_float']:>7.2f}{r['agreement_with_float']:>7.3f}"
              f"{r['bytes']:>9}{r['smaller']:>7.1f}x{r['smaller_weights']:>7.1f}x{r['latency_us_single']:>10.0f}{r['latency_us_batched']:>11.0f}"
              f"{r['faster_single']:>8.2f}x{r['faster_batched']:>10.2f}x  {'met' if r['meets_bar'] else '-'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "run": str(folder), "model_sha256": loaded.sha256, "run_final_accuracy": summary["final_accuracy"],
        "test_windows": int(len(test.y)), "calibration_windows": int(len(calibration)),
        "distillation": {"windows": int(len(pooled_y)), "width": args.student_width, "epochs": args.epochs,
                         "seconds": distil_seconds},
        "bar": BAR, "rows": rows, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
    }, indent=2) + "\n")
    print(f"\n-> {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
