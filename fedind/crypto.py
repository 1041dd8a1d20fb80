r"""Paillier keys, fixed-point slot packing and encrypted weighted sums (pure Python + numpy).

No Flower import: the Flower plumbing (client mod, decrypt query, server validation and
aggregation) is :mod:`fedind.secure`. Arithmetic is phe's Paillier with gmpy2 underneath.

Who holds what
--------------
The sites hold the private key (``p, q``); the server holds only the public key ``n`` and
never opens a private-key file (:func:`load_public_key` refuses one). The server adds
ciphertexts; one key-holding site decrypts the weighted SUM and returns it, so the server
learns the round's aggregate and nothing about a single site's update (README: threat model).

Fixed point, clipping, packing (layout version 1)
-------------------------------------------------
A site's update ``delta`` (float32, all arrays of the model flattened in sorted-name order)
is clipped to ``[-c, c]`` (``c`` = ``paillier-clip``) and quantised to

.. math::  \ell_j = \mathrm{round}\big(\mathrm{clip}(\delta_j, c) \cdot Q / c\big) + Q
           \in [0, 2Q], \qquad Q = 2^{20} - 1,

an offset (non-negative) level. ``S = floor((bits(n) - 1) / 31)`` levels go into one
plaintext, slot ``s`` at bits ``[31 s, 31 s + 31)``:

.. math::  m = \sum_{s<S} \ell_s \, 2^{31 s} < 2^{31 S} \le 2^{bits(n)-1} < n

(66 slots for a 2048-bit key, 33 for 1024; the last plaintext is padded with zero levels).
The server weights the sites with integers :math:`k_i \ge 0`, :math:`\sum_i k_i = W \le K`,
:math:`K = 2^{10}` (:func:`integer_weights` rounds the strategy's weights to multiples of
:math:`1/K`) and computes :math:`\prod_i c_i^{k_i} = \mathrm{Enc}(\sum_i k_i m_i)`. Each
slot then holds :math:`T = \sum_i k_i \ell_i \le W \cdot 2Q \le 2^{10}(2^{21}-2) < 2^{31}`:
the bit budget is 31 = 1 (sign, as the offset) + 20 (value) + 10 (weight headroom), so no
slot can carry into the next whatever the number of sites, and a sum of more than
:data:`MAX_SITES` = K sites (some would get weight 0) is refused. The decrypting site
rejects a slot above :math:`W \cdot 2Q` or any bit above the last slot (a site that
encrypted an out-of-range plaintext) and returns

.. math::  \hat d_j = \frac{T_j - W Q}{W Q}\, c
           = \sum_i \frac{k_i}{W}\, \frac{(\ell_{ij} - Q)\,c}{Q}.

Quantisation bound: every site rounds to the nearest of steps :math:`c/Q`, so
:math:`|\hat d_j - \sum_i \frac{k_i}{W} \mathrm{clip}(\delta_{ij}, c)| \le c / (2Q)`
(:func:`quantisation_bound`; 4.8e-7 for ``c = 1``), plus float32 rounding of the result.

Ciphertexts and speed
---------------------
``c = (1 + m n) \cdot r^n \bmod n^2`` (phe's ``g = n + 1``). The obfuscator :math:`r^n` is
the expensive part; sites know ``p, q`` and draw it by CRT: the n-th residues mod
:math:`p^2` are the subgroup of order :math:`p-1`, and :math:`x \mapsto x^p \bmod p^2`
maps :math:`x` uniform in :math:`[1, p)` uniformly onto it (the map only depends on
:math:`x \bmod p`). So ``y = CRT(x_p^p mod p^2, x_q^q mod q^2)`` is distributed as
:math:`r^n \bmod n^2` for :math:`\gcd(q, p-1) = \gcd(p, q-1) = 1` (checked when a key is made)
at two 1024-bit-exponent powers modulo 2048-bit numbers instead of a 2048-bit exponent
modulo a 4096-bit one (2.6 ms vs 9.1 ms at 2048 bits, ``docs/paillier-bench.json``). :class:`ObfuscatorPool` draws them ahead (e.g.
while the site trains) and in several processes. Decryption is phe's CRT decryption.

Payload (ConfigRecord, no pickle)
---------------------------------
:func:`update_to_record` / :func:`parse_update`; all keys are required, nothing else allowed:

================  ======  ============================================================
key               type    meaning
================  ======  ============================================================
``format``        str     ``"fedind.paillier"``
``version``       int     layout version, ``1``
``kind``          str     ``"update"`` (site -> server) or ``"aggregate"`` (server -> site)
``key``           str     key fingerprint: SHA-256 of ``n`` (big-endian bytes), hex
``count``         int     number of values (the model's parameters)
``slot-bits``     int     31
``value-max``     int     Q = 2**20 - 1
``clip``          float   c
``weight``        int     1 for an update; W = sum of the integer weights for an aggregate
``sites``         int     1 for an update; number of sites in an aggregate
``ciphertexts``   bytes   ceil(count / S) ciphertexts, each big-endian in exactly
                          ``ceil(bits(n^2) / 8)`` bytes (512 for a 2048-bit key), each
                          in ``[1, n^2)``
================  ======  ============================================================
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import stat
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import gmpy2
import numpy as np
from phe import paillier

__all__ = [
    "CiphertextError",
    "EncryptedVector",
    "KeyFileError",
    "MAX_SITES",
    "ObfuscatorPool",
    "PrivateKey",
    "PublicKey",
    "VALUE_MAX",
    "decrypt_sum",
    "encrypt_levels",
    "generate_keypair",
    "integer_weights",
    "load_private_key",
    "load_public_key",
    "parse_record",
    "quantisation_bound",
    "quantise",
    "save_keypair",
    "weighted_sum",
]

FORMAT = "fedind.paillier"
VERSION = 1
SLOT_BITS = 31
WEIGHT_BITS = 10
MAX_SITES = 2**WEIGHT_BITS  # K: the integer weights of a sum add up to at most this
VALUE_BITS = SLOT_BITS - 1 - WEIGHT_BITS  # 20
VALUE_MAX = 2**VALUE_BITS - 1  # Q
MIN_KEY_BITS = 512
PUBLIC_FORMAT = "fedind.paillier-public-key"
PRIVATE_FORMAT = "fedind.paillier-private-key"
PASSPHRASE_ENV = "FEDIND_PAILLIER_PASSPHRASE"
KINDS = ("update", "aggregate")
RECORD_KEYS = frozenset(
    {"format", "version", "kind", "key", "count", "slot-bits", "value-max", "clip", "weight", "sites", "ciphertexts"}
)


class KeyFileError(ValueError):
    """A key file that cannot be used; the message names the file and the fault."""


class CiphertextError(ValueError):
    """An encrypted payload that fails validation; the message names the field and the fault."""


# --------------------------------------------------------------------------- keys


@dataclass(frozen=True)
class PublicKey:
    """The server's part of the key: the modulus ``n``."""

    n: int

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n.bit_length() < MIN_KEY_BITS or self.n % 2 == 0:
            raise KeyFileError(f"Invalid Paillier modulus: need an odd n of at least {MIN_KEY_BITS} bits")

    @property
    def bits(self) -> int:
        return self.n.bit_length()

    @property
    def n_square(self) -> int:
        return self.n * self.n

    @property
    def fingerprint(self) -> str:
        """SHA-256 of ``n`` as big-endian bytes, hex: names the key in payloads and logs."""
        return hashlib.sha256(self.n.to_bytes((self.n.bit_length() + 7) // 8, "big")).hexdigest()

    @property
    def slots(self) -> int:
        """Values per plaintext: ``floor((bits(n) - 1) / 31)``."""
        return (self.bits - 1) // SLOT_BITS

    @property
    def ciphertext_bytes(self) -> int:
        return (self.n_square.bit_length() + 7) // 8

    def num_ciphertexts(self, count: int) -> int:
        return -(-count // self.slots)


class PrivateKey:
    """The sites' key: ``p, q`` (and the public ``n = p q``); encrypts fast, decrypts by CRT."""

    def __init__(self, p: int, q: int) -> None:
        p, q = int(p), int(q)
        if p == q or not gmpy2.is_prime(p) or not gmpy2.is_prime(q):
            raise KeyFileError("Invalid Paillier private key: p and q must be two distinct primes")
        if math.gcd(q, p - 1) != 1 or math.gcd(p, q - 1) != 1:
            raise KeyFileError("Invalid Paillier private key: gcd(q, p-1) and gcd(p, q-1) must be 1")
        self.public = PublicKey(p * q)
        self.p, self.q = p, q
        self._phe = paillier.PaillierPrivateKey(paillier.PaillierPublicKey(self.public.n), p, q)
        self._p2, self._q2 = gmpy2.mpz(p) ** 2, gmpy2.mpz(q) ** 2
        self._q2_inv = gmpy2.invert(self._q2, self._p2)  # CRT: mod q^2 and p^2 -> mod n^2

    @property
    def phe(self) -> paillier.PaillierPrivateKey:
        """The same key as phe's object (for comparisons with per-value phe encryption)."""
        return self._phe

    def obfuscators(self, count: int) -> list[int]:
        """``count`` random n-th residues mod n^2, by CRT (module docstring)."""
        xp = [gmpy2.mpz(1 + secrets.randbelow(self.p - 1)) for _ in range(count)]
        xq = [gmpy2.mpz(1 + secrets.randbelow(self.q - 1)) for _ in range(count)]
        yp = gmpy2.powmod_base_list(xp, self.p, self._p2)
        yq = gmpy2.powmod_base_list(xq, self.q, self._q2)
        return [int(b + self._q2 * (((a - b) * self._q2_inv) % self._p2)) for a, b in zip(yp, yq)]

    def raw_decrypt(self, ciphertext: int) -> int:
        return int(self._phe.raw_decrypt(ciphertext))


def generate_keypair(bits: int = 2048) -> PrivateKey:
    """A fresh key pair (phe's generator; redrawn in the rare case the CRT condition fails)."""
    if not isinstance(bits, int) or bits < MIN_KEY_BITS or bits % 64:
        raise ValueError(f"Invalid key size: {bits!r} (a multiple of 64, at least {MIN_KEY_BITS})")
    while True:
        _, private = paillier.generate_paillier_keypair(n_length=bits)
        try:
            return PrivateKey(private.p, private.q)
        except KeyFileError:
            continue


def save_keypair(key: PrivateKey, private_path: Path, public_path: Path, passphrase: str | None = None) -> None:
    """Write the private key (mode 0600, created exclusively) and the public key (0644).

    With ``passphrase`` the private numbers are sealed with AES-256-GCM under a scrypt key
    (``cryptography``); sites then need the passphrase in ``FEDIND_PAILLIER_PASSPHRASE``.
    """
    private_path, public_path = Path(private_path), Path(public_path)
    secret = json.dumps({"p": _hex(key.p), "q": _hex(key.q)}).encode()
    body: dict = {"format": PRIVATE_FORMAT, "version": 1, "fingerprint": key.public.fingerprint, "n": _hex(key.public.n)}
    if passphrase:
        body.update(_seal(secret, passphrase))
    else:
        body.update(json.loads(secret))
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(body, f, indent=1)
        f.write("\n")
    public = {"format": PUBLIC_FORMAT, "version": 1, "fingerprint": key.public.fingerprint, "n": _hex(key.public.n)}
    fd = os.open(public_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump(public, f, indent=1)
        f.write("\n")


def load_public_key(path: str | Path) -> PublicKey:
    """The server's key file. A private-key file is refused: the server must not hold one."""
    body = _read_key_file(Path(path))
    if body.get("format") == PRIVATE_FORMAT:
        raise KeyFileError(
            f"{path}: this is a Paillier PRIVATE key file; the server takes the public key "
            f"(the .pub file written next to it by `fedind keys paillier`)"
        )
    if body.get("format") != PUBLIC_FORMAT or body.get("version") != 1:
        raise KeyFileError(f"{path}: not a fedind Paillier public key file (format {body.get('format')!r})")
    key = PublicKey(_int(body, "n", path))
    if body.get("fingerprint") != key.fingerprint:
        raise KeyFileError(f"{path}: fingerprint does not match the modulus (file corrupted or edited)")
    return key


def load_private_key(path: str | Path, passphrase: str | None = None) -> PrivateKey:
    """A site's key file: must be readable by its owner only (like ssh keys)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError as err:
        raise KeyFileError(f"{path}: cannot read the Paillier private key ({err.strerror})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(f"{path}: private key file is accessible by others (mode {oct(mode & 0o777)}); chmod 600 it")
    body = _read_key_file(path)
    if body.get("format") != PRIVATE_FORMAT or body.get("version") != 1:
        raise KeyFileError(f"{path}: not a fedind Paillier private key file (format {body.get('format')!r})")
    if "sealed" in body:
        passphrase = passphrase if passphrase is not None else os.environ.get(PASSPHRASE_ENV)
        if not passphrase:
            raise KeyFileError(f"{path}: the key is sealed with a passphrase; set {PASSPHRASE_ENV}")
        body = {**body, **json.loads(_unseal(body, passphrase, path))}
    key = PrivateKey(_int(body, "p", path), _int(body, "q", path))
    if key.public.n != _int(body, "n", path) or body.get("fingerprint") != key.public.fingerprint:
        raise KeyFileError(f"{path}: p*q does not match n or its fingerprint (file corrupted or edited)")
    return key


def _read_key_file(path: Path) -> dict:
    try:
        body = json.loads(path.read_text())
    except OSError as err:
        raise KeyFileError(f"{path}: cannot read the key file ({err.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise KeyFileError(f"{path}: not a JSON key file ({err})") from None
    if not isinstance(body, dict):
        raise KeyFileError(f"{path}: not a fedind key file")
    return body


def _hex(x: int) -> str:
    return format(int(x), "x")


def _int(body: Mapping, name: str, path) -> int:
    try:
        return int(body[name], 16)
    except (KeyError, TypeError, ValueError):
        raise KeyFileError(f"{path}: missing or invalid {name!r}") from None


def _seal(secret: bytes, passphrase: str) -> dict:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    salt, nonce = os.urandom(16), os.urandom(12)
    sealed = AESGCM(_scrypt(passphrase, salt)).encrypt(nonce, secret, PRIVATE_FORMAT.encode())
    return {"sealed": "scrypt-aes256gcm", "salt": salt.hex(), "nonce": nonce.hex(), "ciphertext": sealed.hex()}


def _unseal(body: Mapping, passphrase: str, path) -> bytes:
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    if body.get("sealed") != "scrypt-aes256gcm":
        raise KeyFileError(f"{path}: unknown sealing {body.get('sealed')!r}")
    try:
        key = _scrypt(passphrase, bytes.fromhex(body["salt"]))
        return AESGCM(key).decrypt(bytes.fromhex(body["nonce"]), bytes.fromhex(body["ciphertext"]), PRIVATE_FORMAT.encode())
    except InvalidTag:
        raise KeyFileError(f"{path}: wrong passphrase (or the sealed key was altered)") from None
    except (KeyError, TypeError, ValueError):
        raise KeyFileError(f"{path}: sealed key fields missing or not hex") from None


def _scrypt(passphrase: str, salt: bytes) -> bytes:
    from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

    return Scrypt(salt=salt, length=32, n=2**15, r=8, p=1).derive(passphrase.encode())


# --------------------------------------------------------------------------- fixed point


def quantise(values: np.ndarray, clip: float) -> tuple[np.ndarray, int]:
    """``(levels int64 in [0, 2Q], number of clipped values)`` of finite float ``values``."""
    if not (math.isfinite(clip) and clip > 0):
        raise ValueError(f"Invalid clip value: {clip!r}")
    x = np.asarray(values, dtype=np.float64).ravel()
    if not np.all(np.isfinite(x)):
        raise ValueError(f"cannot encrypt {int(np.size(x) - np.isfinite(x).sum())} NaN/Inf values")
    clipped = int(np.count_nonzero(np.abs(x) > clip))
    levels = np.rint(np.clip(x, -clip, clip) * (VALUE_MAX / clip)).astype(np.int64) + VALUE_MAX
    return levels, clipped


def dequantise(sums: np.ndarray, weight: int, clip: float) -> np.ndarray:
    """The weighted mean of slot sums ``T = sum_i k_i l_i`` with ``W = sum_i k_i = weight``."""
    return ((sums.astype(np.float64) - weight * VALUE_MAX) * (clip / (weight * VALUE_MAX))).astype(np.float32)


def quantisation_bound(clip: float) -> float:
    """Largest |decrypted aggregate - weighted mean of the clipped float updates| (per value)."""
    return clip / (2 * VALUE_MAX)


def pack(levels: np.ndarray, slots: int) -> list[int]:
    """Plaintexts ``m = sum_s l_s 2^(31 s)``, ``slots`` levels each (the last padded with 0)."""
    levels = np.asarray(levels, dtype=np.int64)
    if levels.size and (levels.min() < 0 or levels.max() >= 2**SLOT_BITS):
        raise ValueError("levels must lie in [0, 2^31)")
    rows = -(-levels.size // slots)
    padded = np.zeros(rows * slots, dtype=np.uint64)
    padded[: levels.size] = levels
    bits = ((padded.reshape(rows, slots, 1) >> np.arange(SLOT_BITS, dtype=np.uint64)) & 1).astype(np.uint8)
    packed = np.packbits(bits.reshape(rows, slots * SLOT_BITS), axis=1, bitorder="little")
    return [int.from_bytes(row.tobytes(), "little") for row in packed]


def unpack(plaintexts: Sequence[int], slots: int, count: int) -> np.ndarray:
    """Inverse of :func:`pack` for slot sums: int64 ``[count]``. Raises CiphertextError when a
    plaintext has bits above its last slot (an out-of-range plaintext went into the sum)."""
    width = slots * SLOT_BITS
    nbytes = (width + 7) // 8
    rows = []
    for i, m in enumerate(plaintexts):
        if m >> width:
            raise CiphertextError(
                f"ciphertext {i}: the decrypted sum has bits above its {slots} slots: "
                f"overflow (a site encrypted an out-of-range plaintext)"
            )
        rows.append(np.frombuffer(m.to_bytes(nbytes, "little"), dtype=np.uint8))
    if not rows:
        return np.zeros(0, dtype=np.int64)
    bits = np.unpackbits(np.stack(rows), axis=1, bitorder="little")[:, :width].reshape(-1, slots, SLOT_BITS)
    powers = (1 << np.arange(SLOT_BITS, dtype=np.int64))
    return (bits.astype(np.int64) * powers).sum(axis=2).ravel()[:count]


# --------------------------------------------------------------------------- encryption


class ObfuscatorPool:
    """Obfuscators ``r^n mod n^2`` drawn ahead of use (they do not depend on the plaintext).

    ``fill(count)`` draws now (``workers`` > 1: in that many processes); ``fill_async``
    draws in a background thread (e.g. while the site trains) and ``take`` waits for it.
    Every obfuscator is used once: ``take`` removes what it returns.
    """

    def __init__(self, key: PrivateKey, workers: int = 1) -> None:
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"Invalid workers value: {workers!r}")
        self.key = key
        self.workers = workers
        self._ready: list[int] = []
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._ready)

    def fill(self, count: int) -> None:
        drawn = _draw(self.key, count, self.workers)
        with self._lock:
            self._ready.extend(drawn)

    def fill_async(self, count: int, chunk: int = 32) -> None:
        """Draw ``count`` in a daemon thread, ``chunk`` at a time (the GIL is released between)."""

        def run() -> None:
            left = count
            while left > 0:
                drawn = self.key.obfuscators(min(chunk, left))
                with self._lock:
                    self._ready.extend(drawn)
                left -= len(drawn)

        self.wait()
        self._thread = threading.Thread(target=run, name="paillier-obfuscators", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def take(self, count: int) -> list[int]:
        self.wait()
        with self._lock:
            taken, self._ready = self._ready[:count], self._ready[count:]
        if len(taken) < count:
            taken += _draw(self.key, count - len(taken), self.workers)
        return taken


def _draw(key: PrivateKey, count: int, workers: int) -> list[int]:
    if workers == 1 or count < 2 * workers:
        return key.obfuscators(count)
    sizes = [count // workers + (i < count % workers) for i in range(workers)]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        parts = pool.map(_obfuscators_in_worker, [(key.p, key.q, s) for s in sizes])
        return [y for part in parts for y in part]


def _obfuscators_in_worker(args: tuple[int, int, int]) -> list[int]:
    p, q, count = args
    return PrivateKey(p, q).obfuscators(count)


@dataclass(frozen=True)
class EncryptedVector:
    """Packed ciphertexts of ``count`` values under the key ``fingerprint`` (layout v1)."""

    kind: str
    fingerprint: str
    count: int
    clip: float
    weight: int
    sites: int
    ciphertexts: list[int]

    def to_config(self, key: PublicKey) -> dict:
        """The ConfigRecord content (module docstring); ``key`` gives the ciphertext width."""
        width = key.ciphertext_bytes
        return {
            "format": FORMAT,
            "version": VERSION,
            "kind": self.kind,
            "key": self.fingerprint,
            "count": int(self.count),
            "slot-bits": SLOT_BITS,
            "value-max": VALUE_MAX,
            "clip": float(self.clip),
            "weight": int(self.weight),
            "sites": int(self.sites),
            "ciphertexts": b"".join(int(c).to_bytes(width, "big") for c in self.ciphertexts),
        }


def encrypt_levels(
    levels: np.ndarray, key: PrivateKey, clip: float, pool: ObfuscatorPool | None = None
) -> EncryptedVector:
    """Pack ``levels`` (from :func:`quantise`) and encrypt: ``(1 + m n) r^n mod n^2``."""
    pub = key.public
    plaintexts = pack(levels, pub.slots)
    obfuscators = (pool or ObfuscatorPool(key)).take(len(plaintexts))
    n, n2 = gmpy2.mpz(pub.n), gmpy2.mpz(pub.n_square)
    ciphertexts = [int(((1 + m * n) % n2) * r % n2) for m, r in zip(plaintexts, obfuscators)]
    return EncryptedVector("update", pub.fingerprint, int(np.size(levels)), float(clip), 1, 1, ciphertexts)


def integer_weights(weights: Sequence[float], total: int = MAX_SITES) -> list[int]:
    """Non-negative integers summing to ``total`` with ``k_i / total`` nearest ``w_i / sum w``
    (largest remainders). More than ``total`` sites is refused: the slot headroom is for a
    weight sum of ``MAX_SITES``."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"Invalid weights: {weights!r} (need non-negative finite values, positive sum)")
    if not (isinstance(total, int) and 1 <= total <= MAX_SITES):
        raise ValueError(f"Invalid weight total {total!r}: 1..{MAX_SITES}")
    if w.size > total:
        raise CiphertextError(
            f"{w.size} sites exceed the slot headroom: at most {total} encrypted updates can be "
            f"summed (weights are multiples of 1/{total})"
        )
    exact = w / w.sum() * total
    k = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - k), kind="stable")
    k[order[: total - int(k.sum())]] += 1
    return [int(x) for x in k]


def weighted_sum(vectors: Sequence[EncryptedVector], weights: Sequence[int], key: PublicKey) -> EncryptedVector:
    """``Enc(sum_i k_i m_i) = prod_i c_i^k_i mod n^2`` (server side: public key only).

    The vectors must be validated updates under ``key`` of equal count and clip; the integer
    weights must be >= 0 and sum to at most :data:`MAX_SITES` (the slot headroom)."""
    if len(vectors) != len(weights) or not vectors:
        raise ValueError("weighted_sum needs one integer weight per encrypted update")
    if any(not isinstance(k, int) or k < 0 for k in weights) or not 0 < sum(weights) <= MAX_SITES:
        raise CiphertextError(
            f"integer weights {list(weights)} must be >= 0 with a sum in 1..{MAX_SITES} (the slot headroom)"
        )
    first = vectors[0]
    for v in vectors:
        if v.kind != "update" or v.fingerprint != key.fingerprint:
            raise CiphertextError("weighted_sum takes updates under the server's key only")
        if v.count != first.count or v.clip != first.clip or len(v.ciphertexts) != len(first.ciphertexts):
            raise CiphertextError("encrypted updates of one round differ in count, clip or length")
    n2 = gmpy2.mpz(key.n_square)
    terms = [(v.ciphertexts, k) for v, k in zip(vectors, weights) if k > 0]
    out = []
    for j in range(len(first.ciphertexts)):
        acc = gmpy2.mpz(1)
        for cts, k in terms:
            acc = acc * (cts[j] if k == 1 else gmpy2.powmod(cts[j], k, n2)) % n2
        out.append(int(acc))
    return EncryptedVector("aggregate", key.fingerprint, first.count, first.clip, sum(weights), len(terms), out)


def decrypt_sum(aggregate: EncryptedVector, key: PrivateKey) -> np.ndarray:
    """The weighted mean (float32 ``[count]``) of an aggregate; CiphertextError when a slot
    sum exceeds ``W * 2Q`` or a plaintext has bits above its slots (overflow)."""
    if aggregate.fingerprint != key.public.fingerprint:
        raise CiphertextError(
            f"key fingerprint {aggregate.fingerprint[:16]}… is not this site's key {key.public.fingerprint[:16]}…"
        )
    plaintexts = [key.raw_decrypt(c) for c in aggregate.ciphertexts]
    sums = unpack(plaintexts, key.public.slots, aggregate.count)
    limit = aggregate.weight * 2 * VALUE_MAX
    if sums.size and sums.max() > limit:
        j = int(np.argmax(sums))
        raise CiphertextError(
            f"value {j}: decrypted slot sum {int(sums[j])} exceeds {limit} = weight {aggregate.weight} x 2Q: "
            f"overflow (a site encrypted an out-of-range plaintext)"
        )
    return dequantise(sums, aggregate.weight, aggregate.clip)


# --------------------------------------------------------------------------- payload


def parse_record(
    record: Mapping, key: PublicKey, *, kind: str, count: int | None = None, clip: float | None = None
) -> EncryptedVector:
    """Validate a ConfigRecord (as a mapping) against ``key``; CiphertextError names the fault.

    Checks keys, format, version, kind, key fingerprint, layout constants, ``count`` and
    ``clip`` (when given: what the server expects), weight/sites ranges, the exact byte
    length (``ceil(count / S)`` ciphertexts of fixed width) and every ciphertext in
    ``[1, n^2)``.
    """
    if not isinstance(record, Mapping):
        raise CiphertextError(f"encrypted payload must be a ConfigRecord, got {type(record).__name__}")
    keys = set(record)
    if keys != RECORD_KEYS:
        raise CiphertextError(
            f"encrypted payload keys: missing {sorted(RECORD_KEYS - keys)}, unexpected {sorted(keys - RECORD_KEYS)}"
        )
    if record["format"] != FORMAT or type(record["version"]) is not int or record["version"] != VERSION:
        raise CiphertextError(
            f"format {record['format']!r} version {record['version']!r}: expected {FORMAT!r} version {VERSION}"
        )
    if record["kind"] != kind:
        raise CiphertextError(f"kind {record['kind']!r}: expected {kind!r}")
    if record["key"] != key.fingerprint:
        raise CiphertextError(
            f"key fingerprint {str(record['key'])[:16]}… does not match the federation's public key "
            f"{key.fingerprint[:16]}… (encrypted under another key: provision the current key pair)"
        )
    if (type(record["slot-bits"]), type(record["value-max"])) != (int, int) or (
        record["slot-bits"] != SLOT_BITS or record["value-max"] != VALUE_MAX
    ):
        raise CiphertextError(
            f"layout slot-bits {record['slot-bits']!r}, value-max {record['value-max']!r}: "
            f"expected {SLOT_BITS}, {VALUE_MAX}"
        )
    n = record["count"]
    if type(n) is not int or n < 1 or (count is not None and n != count):
        raise CiphertextError(f"count {n!r}: expected {count if count is not None else 'a positive int'}")
    c = record["clip"]
    if type(c) is not float or not (math.isfinite(c) and c > 0) or (clip is not None and c != clip):
        raise CiphertextError(f"clip {c!r}: expected {clip if clip is not None else 'a positive float'}")
    weight, sites = record["weight"], record["sites"]
    if kind == "update" and (type(weight) is not int or type(sites) is not int or weight != 1 or sites != 1):
        raise CiphertextError(f"an update has weight 1 and sites 1, got {weight!r}, {sites!r}")
    if kind == "aggregate" and not (
        type(weight) is int and type(sites) is int and 1 <= sites <= weight <= MAX_SITES
    ):
        raise CiphertextError(f"aggregate weight {weight!r} / sites {sites!r}: need 1 <= sites <= weight <= {MAX_SITES}")
    blob = record["ciphertexts"]
    if not isinstance(blob, bytes):
        raise CiphertextError(f"ciphertexts is a {type(blob).__name__}, expected bytes")
    width, expected = key.ciphertext_bytes, key.num_ciphertexts(n)
    if len(blob) != width * expected:
        raise CiphertextError(
            f"ciphertexts hold {len(blob)} bytes, expected {expected} x {width} = {width * expected} "
            f"for {n} values (truncated or padded)"
        )
    n2 = key.n_square
    ciphertexts = [int.from_bytes(blob[i : i + width], "big") for i in range(0, len(blob), width)]
    for i, ct in enumerate(ciphertexts):
        if not 0 < ct < n2:
            raise CiphertextError(f"ciphertext {i} is out of range (must lie in [1, n^2))")
        if gmpy2.gcd(ct, key.n) != 1:
            raise CiphertextError(f"ciphertext {i} is not a unit mod n^2 (shares a factor with n)")
    return EncryptedVector(kind, key.fingerprint, n, c, int(weight), int(sites), ciphertexts)
