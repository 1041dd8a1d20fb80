"""The gearbox data family (fedind.data.gearbox): determinism, layout, drift, and physics."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace

import numpy as np
import pytest

from fedind.data import gearbox as gb
from fedind.data.format import load_meta, validate_data_root, validate_phases
from fedind.data.sources import check_data_root

SMALL = gb.GearboxSpec(
    num_sites=4, samples_per_site=40, seed=7, phases=2, regime_share=0.5, new_classes=1,
    speed_factor=1.5, window=1024, global_test_per_class=2,
)
# A line with low noise and its harmonics and resonances well apart: the physics checks.
LINE = gb.GearRegime(
    shaft_hz=20.0, load=0.8, sample_rate=10240.0, gain=(1.0, 1.0), offset=(0.0, 0.0), noise_std=0.01,
    process_noise=0.05, z_in=23, z_out=61, bearing="6206", harmonics=(1.0, 0.4, 0.2), tooth_error=0.03,
    profile_seed=1, resonance_hz=(2500.0, 1800.0), damping=(0.05, 0.05), axial_mesh=0.25, axial_impact=0.4,
)
PER_CLASS = 40
C = {name: i for i, name in enumerate(gb.CLASS_NAMES)}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The specified min_partition_size", UserWarning)
        yield


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The specified min_partition_size", UserWarning)
        return gb.write_gearbox_federation(SMALL, tmp_path_factory.mktemp("gearbox") / "plant")


@pytest.fixture(scope="module")
def windows():
    """``PER_CLASS`` windows of every class on LINE, mean-free, with Hann power spectra."""
    labels = np.repeat(np.arange(gb.NUM_CLASSES), PER_CLASS)
    x = gb.synthesize(labels, LINE, 2048, np.random.default_rng(0)).astype(np.float64)
    x -= x.mean(-1, keepdims=True)
    power = np.abs(np.fft.rfft(x * np.hanning(x.shape[-1]), axis=-1)) ** 2
    return labels, x, np.fft.rfftfreq(x.shape[-1], 1 / LINE.sample_rate), power


def _band(freqs, power, f0, bins=1.0):
    """Power within ``bins`` frequency bins of ``f0`` (last axis)."""
    return power[..., np.abs(freqs - f0) <= bins * freqs[1]].sum(-1)


def _median(values, labels, name):
    return np.median(values[labels == C[name]], axis=0)


# --------------------------------------------------------------------------- arrays


def test_windows_are_float32_two_channels_and_labels_int64():
    for phase in range(SMALL.phases):
        for index in range(SMALL.num_sites):
            for split in gb.phase_site(SMALL, index, phase):
                assert split.x.dtype == np.float32 and split.y.dtype == np.int64
                assert split.x.ndim == 3 and split.x.shape[1:] == (2, SMALL.window)
                assert split.x.shape[0] == split.y.shape[0] > 0
                assert np.isfinite(split.x).all()
    test = gb.phase_global_test(SMALL, 0)
    assert test.x.shape[1:] == (2, SMALL.window) and test.y.dtype == np.int64


def test_same_seed_same_data_other_seed_other_data():
    first = gb.phase_site(SMALL, 1, 1)
    gb.phase_site.cache_clear(), gb.phase_regimes.cache_clear()
    again = gb.phase_site(SMALL, 1, 1)
    for a, b in zip(first, again, strict=True):
        assert np.array_equal(a.x, b.x) and np.array_equal(a.y, b.y)
    other = gb.phase_site(replace(SMALL, seed=8), 1, 1)[0]
    assert other.x.shape != first[0].x.shape or not np.array_equal(other.x, first[0].x)
    labels = np.arange(gb.NUM_CLASSES)
    one = gb.synthesize(labels, LINE, 512, np.random.default_rng(3))
    assert np.array_equal(one, gb.synthesize(labels, LINE, 512, np.random.default_rng(3)))


def test_a_window_depends_on_its_own_label_only():
    labels = np.arange(gb.NUM_CLASSES)
    changed = labels.copy()
    changed[3] = 0
    a = gb.synthesize(labels, LINE, 512, np.random.default_rng(5))
    b = gb.synthesize(changed, LINE, 512, np.random.default_rng(5))
    same = np.arange(gb.NUM_CLASSES) != 3
    assert np.array_equal(a[same], b[same]) and not np.array_equal(a[3], b[3])


def test_bad_labels_and_specs_are_refused():
    with pytest.raises(ValueError, match="labels"):
        gb.synthesize(np.array([gb.NUM_CLASSES]), LINE, 256, np.random.default_rng(0))
    for bad in ({"new_classes": gb.NUM_CLASSES - 1}, {"window": 128}, {"alpha": 0.0}, {"speed_factor": 10.0}):
        with pytest.raises(ValueError):
            replace(SMALL, **bad)


def test_regimes_are_plausible_gearboxes():
    for regime in gb.phase_regimes(gb.GearboxSpec(num_sites=20, seed=3), 0):
        assert 17 <= regime.z_in <= 31 and regime.z_out > regime.z_in
        assert np.gcd(regime.z_in, regime.z_out) == 1  # hunting tooth
        assert regime.mesh_hz == pytest.approx(regime.z_in * regime.shaft_hz)
        assert max(regime.resonance_hz) < 0.4 * regime.sample_rate
        json.dumps(regime.to_dict())


def test_the_cnn_takes_two_channel_gearbox_windows():
    torch = pytest.importorskip("torch")
    from fedind.models import FaultCNN

    x = torch.from_numpy(gb.phase_global_test(SMALL, 1).x[:5])
    model = FaultCNN(in_channels=2, num_classes=gb.NUM_CLASSES)
    assert model(x).shape == (5, gb.NUM_CLASSES)


# --------------------------------------------------------------------------- layout and phases


def test_the_layout_validates_with_fedinds_loaders(written):
    info = validate_data_root(written)
    assert info["sites"] == ["line-00", "line-01", "line-02", "line-03"]
    assert info["sample_shape"] == [2, SMALL.window] and info["has_global_test"]
    assert info["num_classes"] == gb.NUM_CLASSES - 1
    phases = validate_phases(written, SMALL.phases)
    assert phases["max_label"] == gb.NUM_CLASSES - 1 and phases["phase_tests"] == [0, 1]
    assert all(batches == [0, 1] for batches in phases["batches"].values())
    assert check_data_root(str(written))["sites"] == info["sites"]
    meta = load_meta(written)
    assert meta["class_names"] == list(gb.CLASS_NAMES[:-1])
    assert meta["new_class_names"] == [gb.CLASS_NAMES[-1]] and meta["phases"] == 2
    assert meta["generator"]["name"] == "fedind.data.gearbox" and meta["generator"]["seed"] == SMALL.seed
    assert meta["new_class_site"] == f"line-{gb.new_class_site(SMALL):02d}"


def _labels(path):
    with np.load(path, allow_pickle=False) as npz:
        return npz["y"]


def test_phase0_has_no_held_out_class_and_phase1_has_it_at_one_line(written):
    new = gb.NUM_CLASSES - 1
    sites = sorted(p.name for p in (written / "sites").iterdir())
    for site in sites:
        for split in ("train.npz", "test.npz"):
            assert new not in _labels(written / "sites" / site / split)
    assert set(_labels(written / "test.npz")) == set(range(new))
    holders = [
        site for site in sites
        if any(new in _labels(written / "sites" / site / "phase-1" / s) for s in ("train.npz", "test.npz"))
    ]
    assert holders == [load_meta(written)["new_class_site"]]
    assert set(_labels(written / "phase-1" / "test.npz")) == set(range(gb.NUM_CLASSES))


def test_drifted_lines_keep_their_gearbox_and_run_speed_factor_faster(written):
    before, after = gb.phase_regimes(SMALL, 0), gb.phase_regimes(SMALL, 1)
    drifted = gb.drifted_sites(SMALL, 1)
    assert len(drifted) == round(SMALL.regime_share * SMALL.num_sites)
    for i in range(SMALL.num_sites):
        if i in drifted:
            assert after[i].shaft_hz == pytest.approx(before[i].shaft_hz * SMALL.speed_factor)
            assert after[i].mesh_hz == pytest.approx(before[i].mesh_hz * SMALL.speed_factor)
            assert (after[i].z_in, after[i].z_out, after[i].bearing) == (before[i].z_in, before[i].z_out, before[i].bearing)
        else:
            assert after[i] == before[i]
    recorded = load_meta(written)["phase_regimes"]["1"]
    assert sorted(recorded) == [f"line-{i:02d}" for i in drifted]


# --------------------------------------------------------------------------- physics


def test_healthy_spectrum_peaks_at_the_gear_mesh_frequency(windows):
    labels, _, freqs, power = windows
    healthy = power[labels == C["healthy"], 0].mean(0)
    assert abs(freqs[healthy.argmax()] - LINE.mesh_hz) <= 2 * freqs[1]
    # On drawn lines the peak is the mesh frequency or one of its harmonics (a resonance
    # can lift the 2nd above the 1st).
    for index, regime in enumerate(gb.phase_regimes(gb.GearboxSpec(seed=11), 0)):
        x = gb.synthesize(np.zeros(8, np.int64), regime, 2048, np.random.default_rng(index))[:, 0]
        spectrum = (np.abs(np.fft.rfft((x - x.mean(-1, keepdims=True)) * np.hanning(2048), axis=-1)) ** 2).mean(0)
        peak = np.fft.rfftfreq(2048, 1 / regime.sample_rate)[spectrum.argmax()]
        order = round(peak / regime.mesh_hz)
        assert order >= 1 and abs(peak - order * regime.mesh_hz) <= 3 * regime.sample_rate / 2048


def test_misalignment_raises_2x_and_axial_shaft_components(windows):
    labels, _, freqs, power = windows
    two_x = _band(freqs, power, 2 * LINE.shaft_hz)
    one_x = _band(freqs, power, LINE.shaft_hz)
    assert (_median(two_x, labels, "misalignment") > 5 * _median(two_x, labels, "healthy")).all()
    # Misalignment shows on the axial sensor, imbalance on the radial one.
    axial_share = one_x[:, 1] / one_x[:, 0]
    assert _median(axial_share, labels, "misalignment") > 3 * _median(axial_share, labels, "imbalance")


def test_imbalance_raises_1x_radial(windows):
    labels, _, freqs, power = windows
    one_x = _band(freqs, power, LINE.shaft_hz)[:, 0]
    assert _median(one_x, labels, "imbalance") > 5 * _median(one_x, labels, "healthy")


def test_local_tooth_faults_put_sidebands_at_the_pinion_rate(windows):
    labels, _, freqs, power = windows
    radial = power[:, 0]
    sidebands = sum(
        _band(freqs, radial, LINE.mesh_hz + sign * k * LINE.shaft_hz) for k in range(1, 7) for sign in (-1, 1)
    ) / _band(freqs, radial, LINE.mesh_hz)
    healthy = _median(sidebands, labels, "healthy")
    assert _median(sidebands, labels, "tooth-crack") > 1.3 * healthy
    assert _median(sidebands, labels, "tooth-chip") > 1.3 * healthy
    # ... which a fault on the output bearing does not.
    assert _median(sidebands, labels, "bearing-outer-race") < 1.3 * healthy


def test_impacts_and_bursts_make_the_signal_impulsive(windows):
    labels, x, _, _ = windows
    d = np.diff(x[:, 0], axis=-1)
    kurtosis = (d**4).mean(-1) / (d**2).mean(-1) ** 2
    healthy = _median(kurtosis, labels, "healthy")
    for name in ("tooth-chip", "bearing-outer-race", "lubrication-loss"):
        assert _median(kurtosis, labels, name) > 1.5 * healthy, name
    for name in ("tooth-crack", "surface-wear", "misalignment", "imbalance"):
        assert _median(kurtosis, labels, name) < 1.3 * healthy, name


def test_bearing_impacts_recur_at_bpfo_of_the_output_shaft():
    # Envelope of the resonance band: a line at the rate of the outer-race defect.
    labels = np.repeat([C["healthy"], C["bearing-outer-race"]], 20)
    x = gb.synthesize(labels, LINE, 4096, np.random.default_rng(1))[:, 0].astype(np.float64)
    freqs = np.fft.rfftfreq(4096, 1 / LINE.sample_rate)
    spectrum = np.fft.rfft(x, axis=-1)
    spectrum[:, np.abs(freqs - LINE.resonance_hz[0]) > 500] = 0
    envelope = np.abs(np.fft.ifft(np.concatenate([spectrum, np.zeros_like(spectrum[:, 1:-1])], axis=-1), axis=-1))
    envelope -= envelope.mean(-1, keepdims=True)
    env_power = np.abs(np.fft.rfft(envelope * np.hanning(4096), axis=-1)) ** 2
    f_bpfo = LINE.bpfo * LINE.output_hz
    share = _band(freqs, env_power, f_bpfo, 1.5) / env_power[:, (freqs > 2) & (freqs < 200)].sum(-1)
    assert np.median(share[labels == C["bearing-outer-race"]]) > 3 * np.median(share[labels == C["healthy"]])


def test_wear_raises_the_mesh_harmonics_and_lubrication_loss_the_high_band(windows):
    labels, _, freqs, power = windows
    second = _band(freqs, power[:, 0], 2 * LINE.mesh_hz, 2) / _band(freqs, power[:, 0], LINE.mesh_hz, 2)
    assert _median(second, labels, "surface-wear") > 1.5 * _median(second, labels, "healthy")
    high = power[:, 0, freqs > 1500].sum(-1) / power[:, 0].sum(-1)
    assert _median(high, labels, "lubrication-loss") > 3 * _median(high, labels, "healthy")


def test_classes_differ_a_nearest_centroid_on_spectra_beats_chance():
    # A sanity check of learnability (not a benchmark): log spectra of both channels,
    # centroids from half of the windows of each line, tested on the other half.
    correct = total = 0
    for index, regime in enumerate(gb.phase_regimes(gb.GearboxSpec(num_sites=3, seed=5), 0)):
        labels = np.repeat(np.arange(gb.NUM_CLASSES), 16)
        x = gb.synthesize(labels, regime, 2048, np.random.default_rng(index)).astype(np.float64)
        x -= x.mean(-1, keepdims=True)
        logp = np.log(np.abs(np.fft.rfft(x * np.hanning(2048), axis=-1))[..., 1:] ** 2 + 1e-12)
        feats = (logp - logp.mean(-1, keepdims=True)).reshape(len(labels), -1)
        train = np.tile(np.arange(16) < 8, gb.NUM_CLASSES)
        centroids = np.stack([feats[train & (labels == c)].mean(0) for c in range(gb.NUM_CLASSES)])
        guess = ((feats[~train, None] - centroids[None]) ** 2).sum(-1).argmin(-1)
        correct += int((guess == labels[~train]).sum())
        total += int((~train).sum())
    assert correct / total > 3 / gb.NUM_CLASSES  # chance is 1/8


# --------------------------------------------------------------------------- CLI


def test_cli_generates_a_gearbox_federation(tmp_path, capsys):
    from fedind.cli import main

    out = tmp_path / "gearbox"
    argv = ["data", "generate", "--family", "gearbox", "--out", str(out), "--sites", "3", "--samples-per-site", "24"]
    assert main(argv) == 0
    info = validate_data_root(out)
    assert info["sample_shape"] == [2, gb.GearboxSpec().window] and info["num_classes"] == gb.NUM_CLASSES
    assert load_meta(out)["generator"]["name"] == "fedind.data.gearbox"
    printed = capsys.readouterr().out
    assert "rpm" in printed and "line-02" in printed
    assert main(["data", "generate", "--family", "pump", "--out", str(tmp_path / "x")]) == 2
