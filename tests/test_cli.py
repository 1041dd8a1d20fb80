"""The ``fedind`` command line: data generate / data check, exit codes and messages."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedind.cli import flwr_run_command, main
from fedind.data.federation import FederationSpec, make_global_test, make_site
from fedind.data.format import load_global_test, load_site, validate_data_root

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--sites", "3", "--alpha", "0.5", "--seed", "1", "--samples-per-site", "40", "--window", "128"]


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "plant"
    assert main(["data", "generate", "--out", str(out), *SMALL]) == 0
    return out


def test_generate_writes_a_valid_data_root(generated):
    info = validate_data_root(generated)
    assert info["sites"] == ["line-00", "line-01", "line-02"]
    assert info["num_classes"] == 10 and info["sample_shape"] == [1, 128]
    assert info["has_global_test"]
    meta = json.loads((generated / "meta.json").read_text())
    assert meta["num_classes"] == 10 and len(meta["class_names"]) == 10
    assert meta["generator"]["num_sites"] == 3 and meta["generator"]["alpha"] == 0.5
    assert sorted(meta["regimes"]) == info["sites"]
    assert not [p for p in generated.parent.iterdir() if p.name.startswith(".")]  # no temp left


def test_generated_files_hold_exactly_the_synthetic_federation(generated):
    # So `flwr run` on the folder trains on the same data as the in-memory synthetic sites.
    spec = FederationSpec(num_sites=3, alpha=0.5, seed=1, samples_per_site=40, window=128)
    for index, site in enumerate(["line-00", "line-01", "line-02"]):
        on_disk = load_site(generated, site)
        for loaded, made in zip(on_disk, make_site(spec, index), strict=True):
            assert np.array_equal(loaded.x, made.x) and np.array_equal(loaded.y, made.y)
    loaded, made = load_global_test(generated), make_global_test(spec)
    assert np.array_equal(loaded.x, made.x) and np.array_equal(loaded.y, made.y)


def test_generate_prints_sites_and_the_flwr_command(tmp_path, capsys):
    out = tmp_path / "plant"
    assert main(["data", "generate", "--out", str(out), *SMALL]) == 0
    printed = capsys.readouterr().out
    for site in ("line-00", "line-01", "line-02"):
        assert site in printed
    assert "rpm" in printed and "kHz" in printed
    command = (
        f"flwr run . --run-config \"data-root='{out.resolve()}'\" "
        f'--federation-config "num-supernodes=3"'
    )
    assert command in printed


def test_generate_refuses_a_folder_that_is_not_empty(generated, capsys):
    before = sorted(p.relative_to(generated) for p in generated.rglob("*"))
    assert main(["data", "generate", "--out", str(generated), *SMALL]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert sorted(p.relative_to(generated) for p in generated.rglob("*")) == before


def test_generate_into_an_existing_empty_folder(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    assert main(["data", "generate", "--out", str(out), *SMALL]) == 0
    assert validate_data_root(out)["sites"] == ["line-00", "line-01", "line-02"]


def test_check_accepts_the_generated_folder(generated, capsys):
    assert main(["data", "check", str(generated)]) == 0
    printed = capsys.readouterr().out
    assert "sites         3" in printed and "classes       10" in printed
    assert "[C, L] = [1, 128]" in printed
    assert "num-supernodes=3" in printed


def test_check_rejects_float64_x_naming_the_file(generated, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(generated, broken)
    bad = broken / "sites" / "line-01" / "train.npz"
    with np.load(bad) as npz:
        y = npz["y"]
    np.savez(bad, x=np.zeros((len(y), 1, 128)), y=y)  # float64: not the format
    assert main(["data", "check", str(broken)]) == 2
    captured = capsys.readouterr()
    assert str(bad) in captured.err and "float64" in captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_check_of_a_missing_folder_exits_2(tmp_path, capsys):
    assert main(["data", "check", str(tmp_path / "nowhere")]) == 2
    assert "not found" in capsys.readouterr().err


@pytest.mark.parametrize("alpha", ["0", "-0.5", "nan"])
def test_invalid_alpha_exits_2(tmp_path, capsys, alpha):
    out = tmp_path / "plant"
    assert main(["data", "generate", "--out", str(out), "--alpha", alpha]) == 2
    assert "alpha" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["data"],
        ["data", "generate"],  # --out is required
        ["data", "generate", "--out", "x", "--alpha", "abc"],
        ["data", "generate", "--out", "x", "--sites", "2.5"],
        ["data", "check"],
        ["train"],
    ],
)
def test_bad_arguments_exit_2(argv, capsys):
    assert main(argv) == 2
    assert "usage:" in capsys.readouterr().err


def test_invalid_spec_values_exit_2_without_traceback(tmp_path, capsys):
    assert main(["data", "generate", "--out", str(tmp_path / "a"), "--sites", "0"]) == 2
    assert main(["data", "generate", "--out", str(tmp_path / "b"), "--window", "8"]) == 2
    err = capsys.readouterr().err
    assert "argument --sites: must be >= 1" in err and "argument --window: must be >= 64" in err
    assert "Traceback" not in err


def test_flwr_command_quotes_awkward_paths():
    assert flwr_run_command(Path("/data/plant"), 4) == (
        "flwr run . --run-config \"data-root='/data/plant'\" --federation-config \"num-supernodes=4\""
    )
    # A quote in the path: TOML basic string inside shell single quotes; the shell must
    # hand flwr exactly data-root="<path>".
    command = flwr_run_command(Path("/data/o'neil $x"), 2)
    argument = shlex.split(command)[4]
    assert argument == 'data-root="/data/o\'neil $x"'


def test_python_dash_m_runs_the_cli(tmp_path):
    """``python -m fedind`` is the same command line (one process: what each command does is
    checked in process above)."""
    missing = tmp_path / "none"
    done = subprocess.run(
        [sys.executable, "-m", "fedind", "data", "check", str(missing)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert str(missing) in done.stderr + done.stdout
