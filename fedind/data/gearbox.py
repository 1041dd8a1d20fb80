"""A second data family: single-stage spur gearboxes, one per production line, two sensors.

A pinion with ``z_in`` teeth on the input shaft (rate ``f_in``) drives a wheel with
``z_out`` teeth (``f_out = f_in z_in / z_out``); the gear mesh frequency is
``f_m = z_in f_in``. With ``theta(t)`` the input shaft angle in revolutions (speed
fluctuating slowly: ``d theta/dt = f_in (1 + d cos(2 pi f_s t + phi))``) and ``u = z_in theta``
the number of teeth passed, channel ``c`` in {radial, axial} of a window is

    x_c(t) = g_c [ (T_c * s_c)(t) + (R_c * i_c I)(t) + n_c(t) ] + o_c
    s_c(t) = k_c m(t) + sum_k S_ck cos(2 pi k theta + phi_ck) + v_c f(t) + w_c(t)
    m(t)   = W sum_{h=1..3} A_h [1 + a(t)] cos(2 pi h u + h p(t) + phi_h)
    a(t)   = e_in[tooth_in(u)] + e_out[tooth_out(u)] + E_in cos(2 pi theta) + E_out cos(2 pi theta_out) + ...
    p(t)   = q_in[tooth_in(u)] + q_out[tooth_out(u)] + E_in/2 sin(2 pi theta) + E_out/2 sin(2 pi theta_out)

- ``m``: the mesh vibration (transmission error), amplitude ``W`` set by the load (share of
  rated torque) and harmonic weights ``A_h``, amplitude- (``a``) and phase- (``p``)
  modulated by per-tooth errors ``e, q`` (interpolated smoothly from one tooth pair to the
  next: a tooth acts over about two mesh periods) and gear eccentricities ``E``: sidebands
  at ``h f_m +- k f_in`` and ``h f_m +- k f_out``;
- ``S_ck``: shaft harmonics of the input shaft (imbalance ~ f_in^2 at 1x, misalignment at
  2x radial and 1x-3x axial); ``f``: friction noise, modulated over the mesh cycle;
  ``w_c``: broadband process noise (other machinery), structure-borne like the rest;
- ``I = sum_j a_j delta(t - t_j)``: impacts (broken tooth entering mesh, rolling elements
  over a bearing defect); ``T_c`` is the transmissibility of the channel's structural
  resonance (f_c, zeta_c), ``R_c = T_c - 1`` its ringing, normalised to unit peak; the
  axial channel sees the spur mesh (``k_axial``) and the impacts (``i_axial``) weakly;
- ``n_c``: white sensor noise, ``g_c, o_c``: sensor gain and offset; a DAQ anti-alias filter at
  0.42 fs; mesh harmonics above Nyquist are absent.

Classes (severity drawn per window, so mild faults overlap healthy ones): healthy;
tooth-crack (one pinion tooth with a stiffness loss: a once-per-revolution AM/PM burst,
sidebands at ``f_m +- k f_in``); tooth-chip (one pinion tooth losing its share of the load,
and an impact at each revolution as the next tooth takes it); surface-wear (random
tooth-to-tooth errors on both gears, raised 2nd/3rd mesh harmonics: broadband sideband
families); misalignment (2x radial, 1x-3x axial, mesh modulation at 2x, more axial mesh);
imbalance (1x radial ~ f_in^2); bearing-outer-race on the output shaft (impacts at
``BPFO f_out`` with slip: at ratios ``z_out/z_in`` near BPFO they recur at the rate a
chipped pinion tooth does); lubrication-loss (friction noise and scuffing bursts).
Every line has its own gearbox (tooth counts, bearing, per-tooth errors, resonances) and
operating point (speed, load, sample rate, sensor gains/offsets, noise). The federation
(:func:`write_gearbox_federation`) follows :mod:`fedind.data.drift`: the same Dirichlet
label split, drifted lines, new-class line and on-disk phase layout; a drifted line keeps
its gearbox and runs at ``speed_factor`` times its phase-0 speed under a new load and sensor
setting. Everything is a pure function of the spec (seed).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from .drift import DriftSpec, drifted_sites as _drifted_sites, new_class_site as _new_class_site
from .drift import phase_label_sets, write_phase_layout
from .federation import FederationSpec, site_ids
from .format import SiteArrays, write_meta

CLASS_NAMES: tuple[str, ...] = (
    "healthy",
    "tooth-crack",
    "tooth-chip",
    "surface-wear",
    "misalignment",
    "imbalance",
    "bearing-outer-race",
    "lubrication-loss",
)
NUM_CLASSES = len(CLASS_NAMES)
CHANNELS = ("radial", "axial")

# Deep-groove bearings on the output shaft, (balls, ball diameter mm, pitch diameter mm),
# approximate catalogue geometry: BPFO = n/2 (1 - d/D) times the output shaft rate.
BEARINGS = {"6206": (9, 9.525, 46.0), "6308": (8, 15.081, 65.0), "6210": (10, 12.7, 70.0)}
SAMPLE_RATES = (8192.0, 10240.0, 12800.0)
_F_REF = 20.0  # Hz: shaft-harmonic amplitudes are quoted at this input speed
_SETTLE = 7.0  # time constants of the slowest resonance simulated before each window


@dataclass(frozen=True)
class GearRegime:
    """A line's gearbox (hardware) and operating point; per channel: (radial, axial)."""

    # operating point and data acquisition
    shaft_hz: float  # input (pinion) shaft rate
    load: float  # share of rated torque: scales the mesh vibration
    sample_rate: float
    gain: tuple[float, float]
    offset: tuple[float, float]
    noise_std: float  # sensor noise (white), in units of the mesh amplitude at full load
    process_noise: float  # other machinery, flow: broadband, through the transfer paths
    # gearbox
    z_in: int  # pinion teeth
    z_out: int  # wheel teeth (coprime with z_in: a hunting-tooth design)
    bearing: str  # output-shaft bearing, a key of BEARINGS
    harmonics: tuple[float, float, float]  # weights A_h of mesh harmonics 1..3
    tooth_error: float  # std of the per-tooth transmission errors (manufacturing)
    profile_seed: int  # draws the per-tooth errors of this gear pair
    resonance_hz: tuple[float, float]
    damping: tuple[float, float]
    axial_mesh: float  # share of the mesh vibration reaching the axial sensor
    axial_impact: float  # share of the impacts reaching the axial sensor

    @property
    def mesh_hz(self) -> float:
        return self.z_in * self.shaft_hz

    @property
    def output_hz(self) -> float:
        return self.shaft_hz * self.z_in / self.z_out

    @property
    def bpfo(self) -> float:
        """Outer-race defect frequency of the output bearing, as a multiple of ``output_hz``."""
        balls, d, pitch = BEARINGS[self.bearing]
        return balls / 2 * (1 - d / pitch)

    def to_dict(self) -> dict:
        return {**asdict(self), "mesh_hz": self.mesh_hz, "output_hz": self.output_hz}


def _draw_operation(rng: np.random.Generator) -> dict:
    """Operating point and sensor setting of a line (750-1800 rpm input, 30-100 % load)."""
    return {
        "shaft_hz": float(rng.uniform(12.5, 30.0)),
        "load": float(rng.uniform(0.3, 1.0)),
        "sample_rate": float(rng.choice(SAMPLE_RATES)),
        "gain": tuple(float(g) for g in np.exp(rng.uniform(np.log(0.2), np.log(5.0), 2))),
        "offset": tuple(float(o) for o in rng.uniform(-2.0, 2.0, 2)),
        "noise_std": float(rng.uniform(0.005, 0.03)),
        "process_noise": float(rng.uniform(0.03, 0.1)),
    }


def _draw_gearbox(rng: np.random.Generator) -> dict:
    z_in = int(rng.integers(17, 32))
    z_out = int(round(z_in * rng.uniform(1.5, 3.8)))
    while math.gcd(z_in, z_out) != 1:
        z_out += 1
    return {
        "z_in": z_in,
        "z_out": z_out,
        "bearing": str(rng.choice(sorted(BEARINGS))),
        "harmonics": (1.0, float(rng.uniform(0.3, 0.6)), float(rng.uniform(0.1, 0.3))),
        "tooth_error": float(rng.uniform(0.02, 0.04)),
        "profile_seed": int(rng.integers(2**31)),
        "resonance_hz": (float(rng.uniform(1000.0, 3000.0)), float(rng.uniform(800.0, 2800.0))),
        "damping": (float(rng.uniform(0.03, 0.08)), float(rng.uniform(0.03, 0.08))),
        "axial_mesh": float(rng.uniform(0.15, 0.35)),
        "axial_impact": float(rng.uniform(0.3, 0.6)),
    }


def sample_regime(rng: np.random.Generator) -> GearRegime:
    """Draw a plausible line: its gearbox, then its operating point."""
    gearbox = _draw_gearbox(rng)
    return GearRegime(**_draw_operation(rng), **gearbox)


# --------------------------------------------------------------------------- signals


def _paths(regime: GearRegime, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per channel, on the rfft grid of ``size`` samples: the transmissibility ``T`` and the
    ringing ``R = T - 1`` of the structural resonance (unit peak impulse response), both
    through the DAQ's anti-alias filter. Shapes ``[2, size // 2 + 1]``."""
    f = np.fft.rfftfreq(size, 1.0 / regime.sample_rate)
    anti_alias = 1.0 / np.sqrt(1.0 + (f / (0.42 * regime.sample_rate)) ** 16)
    trans, ring = [], []
    for f_c, zeta in zip(regime.resonance_hz, regime.damping):
        r = f / f_c
        den = 1.0 - r**2 + 2j * zeta * r
        t_c = (1.0 + 2j * zeta * r) / den
        r_c = r**2 / den
        r_c = r_c / np.abs(np.fft.irfft(r_c, size)).max()
        trans.append(t_c * anti_alias)
        ring.append(r_c * anti_alias)
    return np.array(trans), np.array(ring)


def _settle(regime: GearRegime) -> int:
    """Samples simulated before each window so the resonances' start-up has died out."""
    slowest = min(z * 2 * np.pi * f for z, f in zip(regime.damping, regime.resonance_hz))
    return int(math.ceil(_SETTLE / slowest * regime.sample_rate))


def _at_tooth(values: np.ndarray, tooth: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Per-tooth ``values [N, z]`` along the mesh: tooth ``tooth`` blending into the next."""
    z = values.shape[1]
    now = np.take_along_axis(values, tooth, axis=1)
    nxt = np.take_along_axis(values, (tooth + 1) % z, axis=1)
    return now + (nxt - now) * step


def _entries(tooth: np.ndarray, which: np.ndarray) -> np.ndarray:
    """Boolean ``[N, T]``: the samples at which tooth ``which[n]`` enters the mesh."""
    on = tooth == which[:, None]
    on[:, 1:] &= ~on[:, :-1]
    on[:, 0] = False
    return on


def _harmonics(c1: np.ndarray, s1: np.ndarray, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(cos k a, sin k a)`` for ``k = 1..count`` from ``cos a, sin a`` (angle addition)."""
    out = [(c1, s1)]
    for _ in range(count - 1):
        c, s = out[-1]
        out.append((c * c1 - s * s1, s * c1 + c * s1))
    return out


def _cos_shift(cs: tuple[np.ndarray, np.ndarray], phase: np.ndarray) -> np.ndarray:
    """``cos(a + phase)`` from ``(cos a, sin a)``; ``phase`` broadcasts."""
    return cs[0] * np.cos(phase) - cs[1] * np.sin(phase)


def synthesize(
    labels: np.ndarray, regime: GearRegime, length: int, rng: np.random.Generator
) -> np.ndarray:
    """Vibration windows ``float32 [N, 2, length]`` (radial, axial) for ``labels`` under ``regime``.

    Every random quantity is drawn for every window and applied where the class calls for
    it: the stream a window consumes does not depend on the labels of the others."""
    labels = np.asarray(labels, dtype=np.int64)
    if labels.size and (labels.min() < 0 or labels.max() >= NUM_CLASSES):
        raise ValueError(f"labels must lie in [0, {NUM_CLASSES}), got {labels.min()}..{labels.max()}")
    n, fs = labels.shape[0], regime.sample_rate
    total = -(-(length + _settle(regime)) // 512) * 512  # FFT-friendly; the window is the tail
    pad = total - length
    t = np.arange(total) / fs
    is_ = {name: (labels == c)[:, None] for c, name in enumerate(CLASS_NAMES)}
    # Phases are accumulated in float64, everything per sample after them in float32.
    col64 = lambda v: np.asarray(v, dtype=np.float64)[..., None]  # noqa: E731
    col = lambda v: np.asarray(v, dtype=np.float32)[..., None]  # noqa: E731
    two_pi = 2 * np.pi

    # Operating point of each window: speed and load jitter, slow speed fluctuation.
    f_in = regime.shaft_hz * (1 + 0.004 * rng.standard_normal(n))
    load = regime.load * rng.uniform(0.95, 1.05, n)
    depth, f_slow, phi = rng.uniform(0.002, 0.006, n), rng.uniform(1.0, 4.0, n), rng.uniform(0, two_pi, n)
    theta = (  # input shaft angle, revolutions
        col64(f_in) * t
        + col64(depth * f_in / (two_pi * f_slow)) * (np.sin(two_pi * col64(f_slow) * t + col64(phi)) - col64(np.sin(phi)))
        + col64(rng.uniform(0, 1, n))
    )
    u = regime.z_in * theta  # teeth passed
    passed = np.floor(u).astype(np.int64)
    frac = (u - passed).astype(np.float32)
    step = 0.5 - 0.5 * np.cos(np.float32(np.pi) * frac)
    start_in, start_out = rng.integers(regime.z_in, size=n), rng.integers(regime.z_out, size=n)
    tooth_in = (passed + start_in[:, None]) % regime.z_in
    tooth_out = (passed + start_out[:, None]) % regime.z_out
    theta_out = (u + start_out[:, None]) / regime.z_out
    angle_in = (two_pi * (theta - np.floor(theta))).astype(np.float32)
    angle_out = (two_pi * (theta_out - np.floor(theta_out))).astype(np.float32)

    # Per-tooth errors (amplitude + 1j * phase): the line's gear pair, then the faults.
    profile = np.random.default_rng(regime.profile_seed)
    err = regime.tooth_error
    err_in = np.tile(profile.normal(0, err, regime.z_in) + 3j * profile.normal(0, err, regime.z_in), (n, 1))
    err_out = np.tile(profile.normal(0, err, regime.z_out) + 3j * profile.normal(0, err, regime.z_out), (n, 1))
    phi_h = [float(p) for p in profile.uniform(0, two_pi, 3)]
    wear = col(rng.uniform(0.05, 0.2, n) * is_["surface-wear"][:, 0])
    err_in += wear * (rng.standard_normal((n, regime.z_in)) + 1.5j * rng.standard_normal((n, regime.z_in)))
    err_out += wear * (rng.standard_normal((n, regime.z_out)) + 1.5j * rng.standard_normal((n, regime.z_out)))
    bad = rng.integers(regime.z_in, size=n)  # the cracked or chipped pinion tooth
    crack, chip = is_["tooth-crack"][:, 0], is_["tooth-chip"][:, 0]
    err_in[np.arange(n), bad] += (
        np.where(crack, rng.uniform(0.3, 0.8, n) + 1j * rng.uniform(0.15, 0.4, n), 0.0)
        + np.where(chip, -rng.uniform(0.6, 1.0, n) + 1j * rng.uniform(0.4, 0.9, n), 0.0)
    )
    err_in, err_out = err_in.astype(np.complex64), err_out.astype(np.complex64)
    tooth_err = _at_tooth(err_in, tooth_in, step) + _at_tooth(err_out, tooth_out, step)

    # Mesh vibration, modulated at both shaft rates.
    ecc_in, ecc_out = rng.uniform(0.02, 0.05, (2, n))
    e_phase = rng.uniform(0, two_pi, (4, n))
    misalign = col(rng.uniform(0.04, 0.3, n) * is_["misalignment"][:, 0])
    unbalance = col(rng.uniform(0.06, 0.4, n) * is_["imbalance"][:, 0])
    rev_in = _harmonics(np.cos(angle_in), np.sin(angle_in), 3)
    rev_out = (np.cos(angle_out), np.sin(angle_out))
    am = (
        1.0
        + tooth_err.real
        + col(ecc_in) * _cos_shift(rev_in[0], col(e_phase[0]))
        + col(ecc_out) * _cos_shift(rev_out, col(e_phase[1]))
        + 0.3 * misalign * _cos_shift(rev_in[1], col(e_phase[2]))  # load varies twice a turn
        + 0.1 * unbalance * _cos_shift(rev_in[0], col(e_phase[3]))
    )
    pm = (
        tooth_err.imag
        + 0.5 * col(ecc_in) * _cos_shift(rev_in[0], col(e_phase[0] - np.pi / 2))
        + 0.5 * col(ecc_out) * _cos_shift(rev_out, col(e_phase[1] - np.pi / 2))
    )
    boost = 6.0 * wear  # worn flanks: more transmission error at the higher harmonics
    mesh_angle = two_pi * frac + pm
    carrier = _harmonics(np.cos(mesh_angle), np.sin(mesh_angle), 3)
    mesh = np.zeros((n, total), dtype=np.float32)
    for h, weight in enumerate(regime.harmonics, start=1):
        if h * regime.mesh_hz * 1.02 >= 0.48 * fs:
            break  # above the DAQ's band
        mesh += weight * (1.0 + (h - 1) * boost) * _cos_shift(carrier[h - 1], phi_h[h - 1])
    mesh *= col(load) * am

    # Input-shaft harmonics (imbalance force ~ speed^2), per channel.
    speed2 = col((f_in / _F_REF) ** 2)
    residual = rng.uniform(0.5, 1.5, (3, n, 1)).astype(np.float32)  # healthy machines are not perfect
    radial_k = (
        (0.04 * residual[0] + unbalance) * speed2 + 0.3 * misalign,
        0.015 * residual[1] + misalign,
        0.1 * misalign,
    )
    axial_k = (0.02 * residual[2] + 0.8 * misalign + 0.1 * unbalance * speed2, 0.01 + 0.6 * misalign, 0.25 * misalign)
    k_phase = rng.uniform(0, two_pi, (2, 3, n))
    shaft = np.zeros((2, n, total), dtype=np.float32)
    for c, amps in enumerate((radial_k, axial_k)):
        for k, amp in enumerate(amps):
            shaft[c] += amp * _cos_shift(rev_in[k], col(k_phase[c, k]))

    # Friction: a little always, much more without lubricant (modulated over the mesh cycle:
    # sliding stops at the pitch point), plus scuffing bursts.
    lube = is_["lubrication-loss"]
    friction_level = col(load * (0.03 + rng.uniform(0.08, 0.3, n) * lube[:, 0]))
    friction = friction_level * (1.0 - 2.0 * step) ** 2  # (1 + cos 2 pi u) / 2
    max_bursts = int(math.ceil(25.0 * total / fs)) + 3
    counts = np.minimum(rng.poisson(rng.uniform(6.0, 20.0, n) * total / fs), max_bursts)
    b_time = rng.uniform(0, total / fs, (n, max_bursts))
    b_width = rng.uniform(0.002, 0.008, (n, max_bursts))
    b_amp = rng.uniform(0.2, 0.8, (n, max_bursts)) * (np.arange(max_bursts) < counts[:, None]) * lube * col(load)
    for j in range(max_bursts):
        live = b_amp[:, j] > 0
        if live.any():
            friction[live] += b_amp[live, j, None] * np.exp(
                -0.5 * ((t - b_time[live, j, None]) / b_width[live, j, None]) ** 2
            )
    friction *= rng.standard_normal((n, total), dtype=np.float32)

    # Impacts: the tooth after a chipped (or, weakly, a cracked) one takes the load at once;
    # rolling elements strike an outer-race defect of the output bearing (1-2 % slip).
    impacts = np.zeros((n, total), dtype=np.float32)
    knock = np.where(chip, rng.uniform(0.8, 3.0, n), 0.0) + np.where(crack, rng.uniform(0.05, 0.3, n), 0.0)
    impacts += _entries(tooth_in, (bad + 1) % regime.z_in) * col(knock * load)
    bearing = is_["bearing-outer-race"][:, 0]
    period = fs / (regime.bpfo * f_in * regime.z_in / regime.z_out)  # samples between strikes
    count = int(total / period.min()) + 2
    positions = (
        rng.uniform(-1, 0, (n, 1)) * col(period)
        + np.arange(count) * col(period)
        + rng.normal(0.0, 0.015, (n, count)) * col(period)
    )
    strike = (rng.uniform(0.6, 2.5, (n, 1)) * rng.uniform(0.9, 1.1, (n, count)) * col64(np.sqrt(load))).astype(np.float32)
    inside = (positions >= 0) & (positions < total) & bearing[:, None]
    r_idx, c_idx = np.nonzero(inside)
    np.add.at(impacts, (r_idx, positions[r_idx, c_idx].astype(np.int64)), strike[r_idx, c_idx])

    # Transfer paths to the two sensors, then the sensors themselves.
    axial_mesh = regime.axial_mesh + 0.6 * misalign  # misalignment loads the tooth edges
    smooth = np.stack([mesh + shaft[0] + friction, axial_mesh * mesh + shaft[1] + 0.5 * friction])
    smooth += regime.process_noise * rng.standard_normal(smooth.shape, dtype=np.float32)
    trans, ring = _paths(regime, total)
    ring = ring * col64((1.0, regime.axial_impact))
    spectrum = np.fft.rfft(smooth, axis=-1) * trans[:, None, :].astype(np.complex64)
    spectrum += np.fft.rfft(impacts, axis=-1)[None] * ring[:, None, :].astype(np.complex64)
    x = np.fft.irfft(spectrum, total, axis=-1)[..., pad:]  # [2, N, length]
    x += regime.noise_std * rng.standard_normal(x.shape, dtype=np.float32)
    x = x * col(regime.gain)[:, :, None] + col(regime.offset)[:, :, None]
    return np.ascontiguousarray(x.transpose(1, 0, 2)).astype(np.float32)


# --------------------------------------------------------------------------- federation


@dataclass(frozen=True)
class GearboxSpec:
    """Everything that determines a synthetic gearbox federation (as :class:`DriftSpec`)."""

    num_sites: int = 10
    alpha: float = 0.3
    samples_per_site: int = 240  # mean windows per line and phase (train + local test)
    seed: int = 0
    phases: int = 1
    regime_share: float = 0.5
    new_classes: int = 1
    speed_factor: float = 1.0
    window: int = 2048
    test_fraction: float = 0.2
    global_test_per_class: int = 6

    def __post_init__(self) -> None:
        if not 0 <= self.new_classes <= NUM_CLASSES - 2:
            raise ValueError(f"Invalid new_classes: {self.new_classes} (need 0..{NUM_CLASSES - 2})")
        if self.window < 256:
            raise ValueError(f"Invalid window: {self.window} (need >= 256 samples)")
        if self.global_test_per_class < 1:
            raise ValueError(f"Invalid global_test_per_class: {self.global_test_per_class} (need >= 1)")
        self.plan  # noqa: B018 -- the remaining checks are FederationSpec's and DriftSpec's

    @property
    def plan(self) -> DriftSpec:
        """The label split, drifted lines and new-class line: those of :mod:`fedind.data.drift`."""
        federation = FederationSpec(
            num_sites=self.num_sites,
            alpha=self.alpha,
            samples_per_site=self.samples_per_site,
            test_fraction=self.test_fraction,
            global_test_per_class=self.global_test_per_class,
            window=self.window,
            seed=self.seed,
        )
        return DriftSpec(federation, self.phases, self.regime_share, self.new_classes, self.speed_factor)

    @property
    def held_out(self) -> int:
        return self.plan.held_out


def _rng(spec: GearboxSpec, *stream: int) -> np.random.Generator:
    # Streams 100+: never shared with the bearing family's (1-3, 10-15).
    return np.random.default_rng([spec.seed, *stream])


def phase_classes(spec: GearboxSpec, phase: int) -> int:
    return NUM_CLASSES - spec.held_out if phase == 0 else NUM_CLASSES


def new_class_site(spec: GearboxSpec) -> int | None:
    """Index of the line that first sees the held-out classes (phase 1); None without any."""
    return _new_class_site(spec.plan)


def drifted_sites(spec: GearboxSpec, phase: int) -> tuple[int, ...]:
    """Lines whose operating point changes at the start of ``phase``."""
    return _drifted_sites(spec.plan, phase)


@functools.lru_cache(maxsize=8)
def phase_regimes(spec: GearboxSpec, phase: int) -> tuple[GearRegime, ...]:
    """Every line's regime in ``phase``: a drifted line keeps its gearbox and runs at
    ``speed_factor`` x its phase-0 speed, under a new load and sensor setting."""
    if phase == 0:
        return tuple(sample_regime(_rng(spec, 101, i)) for i in range(spec.num_sites))
    regimes = list(phase_regimes(spec, phase - 1))
    base = phase_regimes(spec, 0)
    for i in drifted_sites(spec, phase):
        operation = _draw_operation(_rng(spec, 102, phase, i))
        operation["shaft_hz"] = base[i].shaft_hz * spec.speed_factor
        regimes[i] = replace(base[i], **operation)
    return tuple(regimes)


@functools.lru_cache(maxsize=32)
def phase_site(spec: GearboxSpec, index: int, phase: int) -> tuple[SiteArrays, SiteArrays]:
    """Train and local test windows of line ``index`` in ``phase``."""
    if not 0 <= index < spec.num_sites:
        raise ValueError(f"site index {index} outside the federation of {spec.num_sites} sites")
    rng = _rng(spec, 104, phase, index)
    labels = rng.permutation(phase_label_sets(spec.plan, phase, NUM_CLASSES)[index])
    num_test = max(1, int(round(spec.test_fraction * labels.size)))
    x = synthesize(labels, phase_regimes(spec, phase)[index], spec.window, rng)
    return SiteArrays(x[num_test:], labels[num_test:]), SiteArrays(x[:num_test], labels[:num_test])


@functools.lru_cache(maxsize=4)
def phase_global_test(spec: GearboxSpec, phase: int) -> SiteArrays:
    """Every class known in ``phase`` under every line's ``phase`` regime."""
    xs, ys = [], []
    for index, regime in enumerate(phase_regimes(spec, phase)):
        labels = np.repeat(np.arange(phase_classes(spec, phase)), spec.global_test_per_class)
        xs.append(synthesize(labels, regime, spec.window, _rng(spec, 105, phase, index)))
        ys.append(labels)
    return SiteArrays(np.concatenate(xs), np.concatenate(ys))


def write_gearbox_federation(spec: GearboxSpec, out: str | Path) -> Path:
    """Write every phase in the on-disk phase layout, as :func:`~fedind.data.drift.write_drift_federation`."""
    out = Path(out)
    sites = site_ids(spec.num_sites)
    write_phase_layout(
        out,
        spec.phases,
        sites,
        lambda index, phase: phase_site(spec, index, phase),
        lambda phase: phase_global_test(spec, phase),
    )
    source = new_class_site(spec)
    known = phase_classes(spec, 0)
    write_meta(
        out,
        {
            "num_classes": known,
            "class_names": list(CLASS_NAMES[:known]),
            "new_class_names": list(CLASS_NAMES[known:]),
            "phases": spec.phases,
            "channels": list(CHANNELS),
            "generator": {"name": "fedind.data.gearbox", **asdict(spec)},
            "new_class_site": None if source is None else sites[source],
            "regimes": {s: r.to_dict() for s, r in zip(sites, phase_regimes(spec, 0))},
            "phase_regimes": {
                str(p): {sites[i]: phase_regimes(spec, p)[i].to_dict() for i in drifted_sites(spec, p)}
                for p in range(1, spec.phases)
            },
        },
    )
    return out
