"""The ``fedind`` command line: generate and check site data folders.

::

    fedind data generate --out DIR --sites N --alpha A --seed S [--samples-per-site M] [--window L]
    fedind data check DIR
    fedind deploy certs --out DIR [--host NAME_OR_IP ...]     (fedind/cli/deploy.py)
    fedind deploy site-keys --out DIR SITE_ID ... | --data-root DIR
    fedind keys paillier --out DIR [--bits B] [--passphrase-env VAR]   (fedind/cli/keys.py)
    fedind predict --model PATH WINDOWS [--format csv|json] [--out FILE]   (fedind/edge/predict.py)
    fedind serve --model PATH | --watch DIR [--host H] [--port P]         (fedind/edge/serve.py)
    fedind export --model PATH --calibration NPZ --out FILE [--student-width W]   (fedind/edge/export.py)

``generate`` writes a synthetic federation (``fedind.data.federation``) in the site data
format of docs/data-format.md and prints the ``flwr run`` command that trains on it; ``check``
validates any folder in that format. Exit status: 0 on success, 2 for bad arguments or
bad data (one message on stderr, no traceback), 1 when the file system refuses.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
import sys
import uuid
import warnings
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..data import gearbox
from ..data.federation import FederationSpec, site_ids, site_regimes, write_federation
from ..data.format import (
    SITES_DIR,
    TEST_FILE,
    TRAIN_FILE,
    DataFormatError,
    load_meta,
    validate_data_root,
)
from ..data.synthetic import CLASS_NAMES
from ..server.diagnostics import inferred_classes_warning

_SPEC_DEFAULTS = {f.name: f.default for f in dataclasses.fields(FederationSpec)}


class _UsageError(Exception):
    """Arguments that argparse accepted but that cannot work (exit status 2)."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed usage or help already
        return exc.code if isinstance(exc.code, int) else 2
    if not hasattr(args, "run"):
        (args.help_parser or parser).print_help(sys.stderr)
        return 2
    try:
        return args.run(args)
    except (DataFormatError, ValueError, _UsageError) as exc:
        print(f"fedind: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"fedind: error: {exc}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedind", description="Federated fault diagnosis for factory edge sites."
    )
    parser.set_defaults(help_parser=parser)
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    data = commands.add_parser("data", help="generate or check a site data folder")
    data.set_defaults(help_parser=data)
    data_commands = data.add_subparsers(title="commands", metavar="COMMAND")

    gen = data_commands.add_parser(
        "generate",
        help="write a synthetic Non-IID federation in the site data format",
        description="Write a synthetic federation of production lines (label, quantity and "
        "feature skew) as DATA_ROOT/sites/<site-id>/{train,test}.npz, test.npz, meta.json.",
    )
    gen.add_argument("--out", required=True, type=Path, metavar="DIR", help="new or empty folder to write")
    gen.add_argument("--sites", type=_at_least(1), metavar="N", default=_SPEC_DEFAULTS["num_sites"], help="number of sites (default %(default)s)")
    gen.add_argument(
        "--alpha", type=_positive_float, metavar="A", default=_SPEC_DEFAULTS["alpha"],
        help="Dirichlet concentration of the label split, > 0; smaller = more skewed (default %(default)s)",
    )
    gen.add_argument("--seed", type=_at_least(0), metavar="S", default=_SPEC_DEFAULTS["seed"], help="default %(default)s")
    gen.add_argument(
        "--samples-per-site", type=_at_least(20), metavar="M", default=_SPEC_DEFAULTS["samples_per_site"],
        help="mean windows per site, train + local test (default %(default)s)",
    )
    gen.add_argument("--window", type=_at_least(64), metavar="L", default=None,
        help=f"samples per window (default {_SPEC_DEFAULTS['window']}, gearbox {gearbox.GearboxSpec.window})")
    gen.add_argument(
        "--family", choices=("bearing", "gearbox"), default="bearing",
        help="bearing: 1-channel rolling-element bearings, 10 CWRU-like classes; gearbox: 2-channel "
        "(radial, axial) spur gearboxes, 8 classes, fedind.data.gearbox (default %(default)s)",
    )
    gen.set_defaults(run=_generate)

    check = data_commands.add_parser(
        "check", help="validate a site data folder and summarise it",
        description="Check every split under DATA_ROOT (keys, dtypes, shapes, labels, NaN/Inf).",
    )
    check.add_argument("data_root", metavar="DIR", type=Path)
    check.set_defaults(run=_check)

    from .deploy import add_commands as add_deploy_commands  # noqa: PLC0415

    add_deploy_commands(commands)  # fedind deploy certs | site-keys

    from .keys import add_commands as add_keys_commands  # noqa: PLC0415

    add_keys_commands(commands)  # fedind keys paillier

    from .launch import add_commands as add_launch_commands  # noqa: PLC0415

    add_launch_commands(commands)  # fedind check-config | run

    from ..edge.predict import add_commands as add_predict_commands  # noqa: PLC0415

    add_predict_commands(commands)  # fedind predict

    from ..edge.serve import add_commands as add_serve_commands  # noqa: PLC0415

    add_serve_commands(commands)  # fedind serve

    from ..edge.export import add_commands as add_export_commands  # noqa: PLC0415

    add_export_commands(commands)  # fedind export
    return parser


def _at_least(minimum: int):
    """argparse type: an int >= ``minimum``; the error names the option (argparse adds it)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


# --------------------------------------------------------------------------- data generate


def _generate(args: argparse.Namespace) -> int:
    fields = {"num_sites": args.sites, "alpha": args.alpha, "samples_per_site": args.samples_per_site, "seed": args.seed}
    if args.window is not None:
        fields["window"] = args.window
    if args.family == "gearbox":
        spec = gearbox.GearboxSpec(**fields)
        write, regimes, names = gearbox.write_gearbox_federation, gearbox.phase_regimes(spec, 0), gearbox.CLASS_NAMES
    else:
        spec = FederationSpec(**fields)
        write, regimes, names = write_federation, site_regimes(spec), CLASS_NAMES
    out = args.out.expanduser().resolve()
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise _UsageError(f"{out}: already exists and is not an empty folder; choose a new one")
    with warnings.catch_warnings():
        # flwr-datasets warns each time it redraws a split that missed min_partition_size;
        # the redraw is the intended behaviour and the result is valid, so keep it quiet.
        warnings.filterwarnings("ignore", "The specified min_partition_size", UserWarning)
        _write_atomically(spec, out, write)
    info = validate_data_root(out)  # what a site agent will load, read back from disk
    print(f"wrote {spec.num_sites} sites to {out}  (alpha {spec.alpha:g}, seed {spec.seed}, window {spec.window})")
    print()
    print(_site_table(spec, out, info, regimes, names))
    print()
    print(f"global test set: {_count(out / TEST_FILE)} windows (every class under every site's regime)")
    print()
    print("train on it (from the fedind app folder):")
    print(f"  {flwr_run_command(out, len(info['sites']))}")
    return 0


def _write_atomically(spec: FederationSpec | gearbox.GearboxSpec, out: Path, write=write_federation) -> None:
    """Write into a hidden sibling, then rename: a failed run leaves no half-written folder."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(spec, tmp)
        os.replace(tmp, out)  # onto a missing or empty folder
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _site_table(spec: FederationSpec | gearbox.GearboxSpec, root: Path, info: dict, regimes, names) -> str:
    rows = [("site", "train", "test", "dominant classes (share of site)", "speed", "sample rate")]
    for site, regime in zip(site_ids(spec.num_sites), regimes):
        labels = np.concatenate([_labels(root / SITES_DIR / site / name) for name in (TRAIN_FILE, TEST_FILE)])
        rows.append(
            (
                site,
                str(info["num_train"][site]),
                str(_count(root / SITES_DIR / site / TEST_FILE)),
                _dominant(labels, names),
                f"{regime.shaft_hz * 60:.0f} rpm",
                f"{regime.sample_rate / 1000:g} kHz",
            )
        )
    return _format_table(rows, right={1, 2, 4, 5})


def _labels(path: Path) -> np.ndarray:
    with np.load(path, allow_pickle=False) as npz:
        return npz["y"]


def _dominant(labels: np.ndarray, names=CLASS_NAMES, top: int = 3, min_share: float = 0.05) -> str:
    counts = np.bincount(labels, minlength=len(names))
    order = np.argsort(-counts, kind="stable")[:top]
    shares = [(names[c], counts[c] / labels.size) for c in order if counts[c] / labels.size >= min_share]
    return ", ".join(f"{name} {share:.0%}" for name, share in shares)


def flwr_run_command(data_root: Path, num_sites: int) -> str:
    """The ``flwr run`` line that trains on ``data_root`` with one SuperNode per site."""
    path = str(data_root)
    # A TOML literal string, unless the path holds a quote; then a basic string.
    if "'" in path:
        value = '"' + path.replace("\\", "\\\\").replace('"', '\\"') + '"'
    else:
        value = f"'{path}'"
    override = f"data-root={value}"
    if any(ch in override for ch in '"$`\\!'):
        quoted = shlex.quote(override)
    else:
        quoted = f'"{override}"'
    return f'flwr run . --run-config {quoted} --federation-config "num-supernodes={num_sites}"'


# --------------------------------------------------------------------------- data check


def _check(args: argparse.Namespace) -> int:
    root = args.data_root.expanduser().resolve()
    info = validate_data_root(root)
    meta = load_meta(root)
    names = meta.get("class_names")
    channels, length = info["sample_shape"]
    print(f"{root}: valid site data folder")
    print(f"  sites         {len(info['sites'])}")
    print(f"  classes       {info['num_classes']}" + (f" ({', '.join(names)})" if names else ""))
    print(f"  sample shape  [C, L] = [{channels}, {length}]")
    if warning := inferred_classes_warning(info):
        print(f"  warning       {warning}")
    rows = [("site", "train", "test", "size")]
    for site in info["sites"]:
        folder = root / SITES_DIR / site
        test = folder / TEST_FILE
        rows.append(
            (
                site,
                str(info["num_train"][site]),
                str(_count(test)) if test.exists() else "-",
                _megabytes(folder / TRAIN_FILE, test),
            )
        )
    total_train = sum(info["num_train"].values())
    rows.append(("total", str(total_train), "", ""))
    print()
    print(_format_table(rows, right={1, 2, 3}, indent="  "))
    print()
    if info["has_global_test"]:
        print(f"  global test   {_count(root / TEST_FILE)} windows ({_megabytes(root / TEST_FILE)})")
    else:
        print("  global test   none (no test.npz: the server will not evaluate centrally)")
    print()
    print("train on it (from the fedind app folder):")
    print(f"  {flwr_run_command(root, len(info['sites']))}")
    return 0


def _count(path: Path) -> int:
    """Number of examples in a validated split, read from the header of its ``y`` array."""
    with zipfile.ZipFile(path) as archive, archive.open("y.npy") as f:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, _ = read(f)
    return int(shape[0])


def _megabytes(*paths: Path) -> str:
    size = sum(p.stat().st_size for p in paths if p.exists())
    return f"{size / 1e6:.1f} MB"


def _format_table(rows: list[tuple[str, ...]], right: set[int], indent: str = "") -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append((indent + "  ".join(cells)).rstrip())
    return "\n".join(lines)
