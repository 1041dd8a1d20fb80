"""fedind export: int8 static quantisation stays close to the float model, the TorchScript
file runs alone and gives the same outputs (its faster front end computes training's up to
float rounding), distillation moves a student to its teacher."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedind.cli import main as cli_main
from fedind.data.format import SiteArrays, write_split
from fedind.data.synthetic import NUM_CLASSES
from fedind.edge.export import (
    EdgeFrontEnd,
    distil,
    predict_classes,
    quantize_static,
    to_torchscript,
    torchscript_bytes,
    weight_bytes,
)
from fedind.models import FaultCNN, VibrationFrontEnd
from fedind.server.results import save_model


@pytest.fixture(scope="module")
def windows() -> np.ndarray:
    rng = np.random.default_rng(0)
    t = np.arange(512) / 512
    tones = np.sin(2 * np.pi * np.outer(rng.integers(5, 60, 48), t))  # structure, not only noise
    return (tones + 0.3 * rng.standard_normal((48, 512)))[:, None, :].astype(np.float32)


def model(width: int = 16, seed: int = 0) -> FaultCNN:
    torch.manual_seed(seed)
    return FaultCNN(in_channels=1, num_classes=NUM_CLASSES, width=width).eval()


def test_int8_logits_stay_close_and_the_weights_shrink(windows):
    teacher = model()
    int8 = quantize_static(teacher, windows)
    x = torch.from_numpy(windows)
    with torch.no_grad():
        reference, quantized = teacher(x), int8(x)
    spread = float(reference.max() - reference.min())
    assert float((quantized - reference).abs().max()) < 0.1 * spread
    assert weight_bytes(teacher) / weight_bytes(int8) > 3


@pytest.mark.parametrize("length", [512, 333])
def test_the_fast_front_end_computes_the_training_front_end(length):
    x = torch.randn(8, 2, length, generator=torch.Generator().manual_seed(length)) * 5 + 3  # gain and offset
    with torch.no_grad():
        reference, fast = VibrationFrontEnd()(x), EdgeFrontEnd(length)(x)
    assert fast.shape == reference.shape
    assert float((fast - reference).abs().max()) < 1e-4  # float rounding (values of order 1)


def test_the_float_file_gives_the_models_outputs_up_to_rounding(windows, tmp_path):
    teacher = model()
    path = tmp_path / "f.pt"
    path.write_bytes(torchscript_bytes(to_torchscript(teacher, windows.shape[1:])))
    x = torch.from_numpy(windows)
    with torch.no_grad():
        reference, exported = teacher(x), torch.jit.load(str(path))(x)
    assert float((exported - reference).abs().max()) < 1e-4
    assert torch.equal(exported.argmax(1), reference.argmax(1))


def test_the_torchscript_file_runs_alone_and_gives_the_same_outputs(windows, tmp_path):
    int8 = quantize_static(model(), windows)
    scripted = to_torchscript(int8, windows.shape[1:])
    path = tmp_path / "m.pt"
    path.write_bytes(torchscript_bytes(scripted))
    loaded = torch.jit.load(str(path))
    x = torch.from_numpy(windows)
    with torch.no_grad():
        assert torch.equal(loaded(x), scripted(x))
        reference = int8(x)  # with training's front end: the same up to rounding (and a quantisation step)
        assert float((loaded(x) - reference).abs().max()) < 0.02 * float(reference.max() - reference.min())


def test_distillation_moves_the_student_to_its_teacher(windows):
    teacher = model(width=16, seed=1)
    torch.manual_seed(3)
    before = FaultCNN(in_channels=1, num_classes=NUM_CLASSES, width=4).eval()
    student = distil(teacher, windows, None, width=4, epochs=15, seed=3)
    target = predict_classes(teacher, windows)
    assert np.mean(predict_classes(student, windows) == target) > np.mean(predict_classes(before, windows) == target)
    with pytest.raises(ValueError, match="Invalid distillation settings"):
        distil(teacher, windows, None, width=4, epochs=0)


def test_export_command_writes_a_verified_int8_model(windows, tmp_path, capsys):
    state = {k: v.numpy() for k, v in model().state_dict().items()}
    save_model(tmp_path / "model.safetensors", state, {"format": "fedind.FaultCNN"})
    y = np.arange(len(windows), dtype=np.int64) % NUM_CLASSES
    write_split(tmp_path / "train.npz", SiteArrays(windows, y))
    out = tmp_path / "int8.pt"
    argv = ["export", "--model", str(tmp_path / "model.safetensors"), "--calibration", str(tmp_path / "train.npz"),
            "--out", str(out)]
    assert cli_main(argv) == 0
    assert "agrees with the float model" in capsys.readouterr().out
    assert torch.jit.load(str(out))(torch.from_numpy(windows)).shape == (len(windows), NUM_CLASSES)
    assert cli_main([*argv[:-1], str(tmp_path / "float.pt"), "--float"]) == 0
    assert ": float model of" in capsys.readouterr().out
    with torch.no_grad():
        assert torch.equal(torch.jit.load(str(tmp_path / "float.pt"))(torch.from_numpy(windows)).argmax(1),
                           model()(torch.from_numpy(windows)).argmax(1))
    (tmp_path / "model.safetensors.sha256").write_text("0" * 64 + "  model.safetensors\n")
    assert cli_main(argv) == 2
    assert "SHA-256" in capsys.readouterr().err
