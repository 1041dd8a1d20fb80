r"""The wire codec of top-k updates: a self-describing, versioned payload, checked field
by field when decoded (pure numpy; Flower only in :func:`to_record`, imported there).

Server, every reply::

    try:
        delta = decode(from_record(record), expected_of(global_arrays))
    except PayloadError as err:                          # reject this reply, log str(err)
        ...

What a payload carries is made by :mod:`fedind.topk.selection` (:class:`SparseTensor`) and
:mod:`fedind.topk.feedback`; the byte blocks are coded in :mod:`fedind.topk.blocks`.

Wire format version 5 (current; what :func:`encode` writes)
----------------------------------------------------------
Version 4 with the code-length table moved into the records, lossless (the same arrays):
every int4 record with ``count > 0`` carries **its own 3-byte code-length table**, right
after its count; there is no table after the fingerprint. In the value stream (still after
the last record: every sign bit in record order, then the codewords) each record's
magnitudes are coded with its own table, record after record. The layers of a network
crowd different magnitudes (on the plant's warm-up round one convolution's codes are
mostly 2-4, another's 1), so one code per tensor comes nearer their entropy than one for
the payload: on the plant runs a warm-up payload is 2.5 % smaller on average (15-360 B),
a later one about 6 % (75 B).

Wire format version 4 (older; still decoded, written with ``encode(..., version=4)``)
----------------------------------------------------------------------------------
Version 3's records with two changes, both lossless (the decoded arrays are those of
version 3 to the bit); on the plant runs a warm-up reply is 15 % smaller, a later reply's
payload 7 % and a downlink step 17 %:

- **zero codes are left out**: a coordinate whose code is 0 decodes to 0 either way, so
  ``count`` counts the non-zero codes only, and a decoder refuses a zero code (int8).
- **int4 magnitudes are Huffman-coded**, one code for the whole payload: after the
  fingerprint a 3-byte **code-length table**, the code length (0 = absent, at most 7) of
  each magnitude 1..7 in 3 bits, LSB first, padding bits 0; the code is canonical (codes
  assigned in order of length, then magnitude) and must satisfy Kraft's inequality. The
  int4 records carry no value block; after the last record comes one **value stream**:
  every value's sign bit (1 = negative) in record order, then every value's codeword (most
  significant bit first), LSB first, padded with fewer than 8 zero bits. With no value
  sent, the table is zero and the stream empty. Top-k codes crowd the low magnitudes when
  one value sets a tensor's scale (the warm-up round: 1 and 2 in three quarters of its
  values), so a code near their entropy beats version 3's fixed width. int8 and sign
  payloads keep version 3's value blocks.

Wire format version 3 (older; still decoded, written with ``encode(..., version=3)``)
----------------------------------------------------------------------------------
Version 2's records (below) with two changes that make a top-k payload about 15 %
smaller at 1.5 % density, losslessly (the same codes and indices as version 2):

- index encoding ``3`` = **Rice**, chosen when it is the smallest of the three. The block
  is the Rice parameter ``k`` (1 byte, ``<= 31``), then one bit stream (LSB first) of
  every gap's ``k``-bit remainder, followed by every gap's quotient ``q`` as ``q`` zero
  bits and a one, padded with zero bits to a whole byte (less than a byte of padding).
  The gaps are ``idx[0]`` and ``idx[i] - idx[i-1] - 1``, so duplicates cannot be written;
  ``gap = q * 2**k + remainder``. Geometric-like gaps of mean ``m`` take about
  ``log2(m) + 1.5`` bits where a varint takes 8 or 16.
- the **value block** of ``int8`` and ``int4``: ``low`` (1 byte, the smallest code
  magnitude), ``width`` (1 byte, ``<= 7``, the bits of ``|code| - low``), then per value
  its sign bit (1 = negative) and ``width`` bits of ``|code| - low`` (LSB first), padded
  with zero bits to a whole byte. Top-k values lie between the threshold and the maximum,
  so their int4 codes are mostly 4 to 7: 3 bits instead of 4. Every magnitude must be
  ``<= levels``; a sign bit on magnitude 0 is rejected. ``sign`` mode: as version 2.

Wire format version 2 (older; still decoded, written with ``encode(..., version=2)``)
-------------------------------------------------------------------------------------
Fixed integers little-endian; ``varint`` is unsigned LEB128 (minimal, at most 5 bytes,
< 2**32). Tensors are identified by POSITION, not by name: record ``i`` belongs to the
``i``-th name of the model's arrays sorted by Unicode code point (Python's ``sorted``;
:func:`encode` sorts the names of its input, :func:`decode` iterates
``sorted(expected)``). There is a record for every array, none is named and none carries
its size: the receiver's ``expected`` shapes give ``numel``, and the layout fingerprint
makes sure sender and receiver mean the same layout.

===============  =======  ============================================================
field            bytes    meaning
===============  =======  ============================================================
magic            4        ``b"FIDZ"``
version          1        ``2``
mode             1        value quantisation: ``1`` = int8, ``2`` = sign (1 bit + scale),
                          ``3`` = int4
fingerprint      4        u32 layout fingerprint (below); must equal the receiver's
*for each array, in sorted-name order:*
count            varint   number of sent coordinates, ``<= numel``; if ``0``, the record
                          ends here (no scale, blocks or lengths)
scale            4        f32, finite, ``> 0`` (only if ``count > 0``)
index enc.       1        ``1`` = delta-varint, ``2`` = bitmap (only if ``count > 0``)
index length     varint   ``I`` (only if ``count > 0``)
index block      I        as in version 1; a bitmap is ``ceil(numel / 8)`` bytes
value block      V        ``V = count`` int8 codes in ``[-127, 127]`` (int8), or
                          ``V = ceil(count / 2)`` bytes of int4 codes in ``[-7, 7]`` (4-bit
                          two's complement, low nibble first, padding nibble 0), or
                          ``V = ceil(count / 8)`` bytes of sign bits (1 = negative, LSB
                          first, padding bits 0); the length is implied, not sent
===============  =======  ============================================================

The payload ends after the last array's record (trailing bytes are an error). The layout
fingerprint is ``zlib.crc32`` of the UTF-8 bytes of the compact, ASCII-escaped JSON list
of ``[name, [dims...]]`` pairs in sorted-name order, e.g.
``[["b",[3]],["w",[2,4]]]`` (``json.dumps(..., separators=(",", ":"))``): a payload built
for other array names or shapes is rejected ("layout fingerprint mismatch") instead of
being decoded into the wrong arrays. Dtypes are not part of it.

Wire format version 1 (older; still decoded, written with ``encode(..., version=1)``)
-------------------------------------------------------------------------------------
All integers little-endian. Tensors are identified by name and may come in any order.

============  =======  ===============================================================
field         bytes    meaning
============  =======  ===============================================================
magic         4        ``b"FIDZ"``
version       1        ``1``
mode          1        value quantisation: ``1`` = int8, ``2`` = sign (1 bit + scale)
tensors       4        u32 ``T``, number of tensor records that follow
*T times:*
name length   2        u16 ``L``
name          L        UTF-8 array name (as in the model's state dict)
numel         4        u32 number of elements of the dense array
count         4        u32 number of sent coordinates, ``<= numel``
scale         4        f32, finite; ``> 0`` if ``count > 0``, ``0`` if ``count == 0``
index enc.    1        ``1`` = delta-varint, ``2`` = bitmap (smaller one, per tensor)
index length  4        u32 ``I``
index block   I        see below
value length  4        u32 ``V``: ``count`` (int8), ``ceil(count / 2)`` (int4) or ``ceil(count / 8)`` (sign)
value block   V        int8 codes in ``[-127, 127]``, or sign bits (1 = negative,
                       LSB first, padding bits 0)
============  =======  ===============================================================

Index blocks (both versions) hold the flat (C-order) indices, strictly increasing:

- delta-varint: ``count`` unsigned LEB128 varints (minimal, at most 5 bytes, < 2**32) of
  ``idx[0]`` then ``idx[i] - idx[i-1]`` — a zero delta is a duplicate index;
- bitmap: ``ceil(numel / 8)`` bytes, bit ``i`` (LSB first) set iff index ``i`` is sent,
  padding bits 0, popcount ``== count``.

The encoder picks, per tensor, whichever index block is smaller (varint on ties). No
pickle anywhere. :func:`decode` checks every field and raises :class:`PayloadError` with
the reason; nothing of a malformed payload is used.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections.abc import Mapping

import numpy as np

from .blocks import (
    HUFFMAN_SYMBOLS,
    INDEX_BITMAP,
    INDEX_NAMES,
    INDEX_VARINT,
    PayloadError,
    Reader,
    codes_size,
    decode_codes,
    decode_codes_v3,
    decode_huffman,
    decode_indices,
    encode_codes,
    encode_codes_v3,
    encode_indices,
    encode_varints,
    huffman_bits,
    huffman_lengths,
    pack_lengths,
    table_size,
    unpack_lengths,
)
from .selection import U32_MAX, SparseTensor, dequantise

__all__ = [
    "FORMAT",
    "MAGIC",
    "VERSION",
    "VERSIONS",
    "PayloadError",
    "decode",
    "dense_size_bytes",
    "encode",
    "encoded_size",
    "expected_of",
    "from_record",
    "layout_fingerprint",
    "to_record",
]

MAGIC = b"FIDZ"
VERSION = 5  # what encode() writes
VERSIONS = (1, 2, 3, 4, 5)  # what decode() reads
_MODE_CODE = {"int8": 1, "sign": 2, "int4": 3}
_MODE_NAME = {v: k for k, v in _MODE_CODE.items()}
_INDEX_ENCODINGS = {1: (INDEX_VARINT, INDEX_BITMAP), 2: (INDEX_VARINT, INDEX_BITMAP), 3: tuple(INDEX_NAMES), 4: tuple(INDEX_NAMES),
                   5: tuple(INDEX_NAMES)}

# The ConfigRecord that carries a payload: {PAYLOAD_KEY: bytes}; FORMAT_KEY and VERSION_KEY only in older records.
FORMAT = "fedind.topk"
FORMAT_KEY = "format"
VERSION_KEY = "version"
PAYLOAD_KEY = "payload"


# --------------------------------------------------------------------------- encode / decode

_HEADER = struct.Struct("<4sBBI")  # magic, version, mode, tensors (v1) / fingerprint (v2, v3)
_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_F32 = struct.Struct("<f")
_TENSOR_FIXED = struct.Struct("<IIfB")  # numel, count, scale, index encoding (v1)
_SCALE_ENC = struct.Struct("<fB")  # scale, index encoding (v2, v3)


def layout_fingerprint(shapes: Mapping) -> int:
    """The version-2 layout fingerprint (u32) of ``{name: shape}``.

    ``zlib.crc32`` of the compact, ASCII-escaped JSON of ``[[name, [dims...]], ...]`` in
    sorted-name order. ``shapes`` values may be shapes, arrays (anything with ``.shape``)
    or ``(shape, dtype)`` pairs as in :func:`expected_of`; dtypes do not count.
    """
    layout = []
    for name in sorted(shapes):
        s = shapes[name]
        if hasattr(s, "shape"):
            s = s.shape
        elif isinstance(s, tuple) and len(s) == 2 and isinstance(s[0], tuple):
            s = s[0]
        layout.append([name, [int(d) for d in s]])
    text = json.dumps(layout, separators=(",", ":"), ensure_ascii=True)
    return zlib.crc32(text.encode("utf-8")) & U32_MAX


def _encode_varint(value: int) -> bytes:
    return encode_varints(np.array([value], dtype=np.uint64))


def _without_zero_codes(t: SparseTensor) -> SparseTensor:
    """``t`` less the coordinates whose code is 0 (they decode to 0 either way)."""
    keep = t.codes != 0
    if keep.all():
        return t
    scale = t.scale if keep.any() else 0.0
    return SparseTensor(t.shape, t.indices[keep], t.codes[keep], scale, t.mode)


def _magnitude_run(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A run of the value stream: the Huffman symbols of ``codes`` (int4 magnitude - 1) and
    their code lengths (zeros for magnitudes absent)."""
    symbols = np.abs(codes.astype(np.int16)) - 1
    return symbols, huffman_lengths(np.bincount(symbols, minlength=HUFFMAN_SYMBOLS))


def encode(sparse: Mapping[str, SparseTensor], version: int = VERSION) -> bytes:
    """The payload of ``sparse`` in wire format ``version`` (see the module docstring).

    ``sparse`` must hold every array of the model (as :meth:`ErrorFeedback.compress`
    returns it), all in one mode. Versions 2 to 5 (5 is the default) write the arrays in
    sorted-name order, identified by position and the layout fingerprint; version 1 writes
    them in the mapping's order, by name. Shapes travel as ``numel`` (v1) or not at all (v2, v3);
    the receiver knows them (:func:`decode`'s ``expected``).
    """
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version not in VERSIONS:
        raise ValueError(f"Invalid version: {version!r} (expected one of {VERSIONS})")
    if not isinstance(sparse, Mapping) or not sparse:
        raise ValueError("Invalid sparse update: expected a non-empty mapping of name -> SparseTensor")
    if not all(isinstance(t, SparseTensor) for t in sparse.values()):
        raise ValueError("Invalid sparse update: every value must be a SparseTensor")
    for name in sparse:
        if not isinstance(name, str):
            raise ValueError(f"Invalid tensor name: {name!r}")
    modes = {t.mode for t in sparse.values()}
    if len(modes) != 1:
        raise ValueError(f"Invalid sparse update: mixed modes {sorted(modes)}")
    if len(sparse) > U32_MAX:
        raise ValueError("Invalid sparse update: too many tensors")
    mode = modes.pop()
    if version >= 2:
        fingerprint = layout_fingerprint({name: t.shape for name, t in sparse.items()})
        tensors = [_without_zero_codes(sparse[name]) if version >= 4 else sparse[name] for name in sorted(sparse)]
        stream = version >= 4 and mode == "int4"
        per_record = stream and version >= 5  # a code-length table in every record
        parts = [_HEADER.pack(MAGIC, version, _MODE_CODE[mode], fingerprint)]
        if stream:
            codes = np.concatenate([t.codes for t in tensors]).astype(np.int16)
            # (symbols, code lengths) of each run of the value stream: one per record (v5) or one in all (v4)
            runs = [_magnitude_run(t.codes) for t in tensors] if per_record else [_magnitude_run(codes)]
            if not per_record:
                parts.append(pack_lengths(runs[0][1]))
        for i, t in enumerate(tensors):
            parts.append(_encode_varint(t.count))
            if t.count == 0:
                continue
            if per_record:
                parts.append(pack_lengths(runs[i][1]))
            encoding, index_block = encode_indices(t.indices, t.numel, rice=version >= 3)
            parts += [_SCALE_ENC.pack(t.scale, encoding), _encode_varint(len(index_block)), index_block]
            if not stream:
                parts.append(encode_codes_v3(t) if version >= 3 else encode_codes(t))
        if stream and codes.size:
            words = [huffman_bits(symbols, lengths) for symbols, lengths in runs]
            bits = np.concatenate([(codes < 0).astype(np.uint8), *words])
            parts.append(np.packbits(bits, bitorder="little").tobytes())
        return b"".join(parts)

    parts = [_HEADER.pack(MAGIC, 1, _MODE_CODE[mode], len(sparse))]
    for name, t in sparse.items():
        raw = name.encode("utf-8")
        if len(raw) > 0xFFFF:
            raise ValueError(f"Invalid tensor name: {len(raw)} bytes (at most 65535)")
        encoding, index_block = encode_indices(t.indices, t.numel)
        value_block = encode_codes(t)
        parts += [
            _U16.pack(len(raw)),
            raw,
            _TENSOR_FIXED.pack(t.numel, t.count, t.scale, encoding),
            _U32.pack(len(index_block)),
            index_block,
            _U32.pack(len(value_block)),
            value_block,
        ]
    return b"".join(parts)


def encoded_size(sparse: Mapping[str, SparseTensor], version: int = VERSION) -> int:
    """Bytes of :func:`encode`'s payload for ``sparse`` in wire format ``version``."""
    return len(encode(sparse, version))


def dense_size_bytes(shapes) -> int:
    """Bytes of the same arrays sent dense as float32: ``4 * total elements``.

    ``shapes``: an iterable of shapes, or a mapping whose values are shapes, arrays
    (anything with ``.shape``) or ``(shape, dtype)`` pairs as in :func:`expected_of`.
    """
    items = shapes.values() if isinstance(shapes, Mapping) else shapes
    total = 0
    for s in items:
        if hasattr(s, "shape"):
            s = s.shape
        elif isinstance(s, tuple) and len(s) == 2 and isinstance(s[0], tuple):
            s = s[0]
        total += math.prod(int(d) for d in s)
    return 4 * total


def expected_of(arrays: Mapping) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``{name: (shape, dtype)}`` of arrays: numpy arrays, or a Flower ``ArrayRecord``
    (its ``Array`` values have ``.shape`` and a numpy dtype name)."""
    return {name: (tuple(int(d) for d in a.shape), np.dtype(a.dtype)) for name, a in arrays.items()}


def _check_expected(expected: Mapping) -> dict[str, tuple[tuple[int, ...], int]]:
    """Caller's ``expected`` -> ``{name: (shape, numel)}``; a bad one is a ValueError (not
    the site's fault, so not a PayloadError)."""
    if not isinstance(expected, Mapping) or not expected:
        raise ValueError("Invalid expected: a non-empty mapping of name -> (shape, dtype)")
    out = {}
    for name, spec in expected.items():
        if not isinstance(name, str):
            raise ValueError(f"Invalid expected name: {name!r} (array names are strings)")
        try:
            shape, dtype = spec
            shape = tuple(int(d) for d in shape)
            dtype = np.dtype(dtype)
        except (TypeError, ValueError) as err:
            raise ValueError(f"Invalid expected[{name!r}]: {spec!r} is not (shape, dtype)") from err
        if not np.issubdtype(dtype, np.floating):
            raise ValueError(f"Invalid expected[{name!r}]: dtype {dtype} cannot carry a compressed delta")
        out[name] = (shape, math.prod(shape))
    return out


def _check_scale(scale: float, count: int, where: str) -> None:
    if not math.isfinite(scale):
        raise PayloadError(f"{where}: non-finite scale {scale}")
    if count > 0 and not scale > 0:
        raise PayloadError(f"{where}: scale {scale} must be > 0 when {count} values are sent")
    if count == 0 and scale != 0:
        raise PayloadError(f"{where}: scale {scale} must be 0 when no values are sent")


def _dense(indices: np.ndarray, codes: np.ndarray, scale: float, mode: str,
           shape: tuple[int, ...], numel: int, where: str) -> np.ndarray:
    """The dense float32 array of one tensor record's decoded and checked fields."""
    values = dequantise(codes, scale, mode)
    if not np.all(np.isfinite(values)):  # cannot happen for a finite float32 scale
        raise PayloadError(f"{where}: non-finite values")
    dense = np.zeros(numel, dtype=np.float32)
    dense[indices] = values
    return dense.reshape(shape)


def decode(payload: bytes, expected: Mapping) -> dict[str, np.ndarray]:
    """Dense float32 deltas ``{name: array of the expected shape}`` from a payload of wire
    format version 1 to 5 (the payload says which).

    ``expected``: ``{name: (shape, dtype)}`` of every array the update must carry (e.g.
    :func:`expected_of` of the global arrays); floating dtypes only. Versions 2 and 3 match
    records to ``sorted(expected)`` by position, after checking the layout fingerprint.
    Every field is validated; any problem raises :class:`PayloadError` naming the field
    and the reason. The result, in ``expected``'s order, equals
    ``{n: t.to_dense() for n, t in sparse.items()}`` of the encoded ``sparse`` bit for bit.
    """
    spec = _check_expected(expected)
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise PayloadError(f"payload must be bytes, got {type(payload).__name__}")
    r = Reader(bytes(payload))
    magic = r.take(4, "magic")
    if magic != MAGIC:
        raise PayloadError(f"bad magic {magic!r} (expected {MAGIC!r})")
    (version,) = r.unpack(_U8, "version")
    if version not in VERSIONS:
        raise PayloadError(f"unknown version {version} (this decoder reads {', '.join(map(str, VERSIONS))})")
    (mode_code,) = r.unpack(_U8, "mode")
    if mode_code not in _MODE_NAME:
        raise PayloadError(f"unknown mode {mode_code} (known: {_MODE_NAME})")
    mode = _MODE_NAME[mode_code]
    out = _decode_v1(r, spec, mode) if version == 1 else _decode_positional(r, spec, mode, version)
    if r.pos != len(r.data):
        raise PayloadError(f"{len(r.data) - r.pos} trailing bytes after the last tensor")
    missing = [n for n in spec if n not in out]
    if missing:
        raise PayloadError(f"missing tensor(s): {missing}")
    return {name: out[name] for name in spec}


def _decode_positional(r: Reader, spec: dict, mode: str, version: int) -> dict[str, np.ndarray]:
    """Versions 2, 3 and 4 (the same records; version 3 adds Rice indices and packed values,
    version 4 the int4 values in one Huffman-coded stream after the records)."""
    (fingerprint,) = r.unpack(_U32, "layout fingerprint")
    want = layout_fingerprint({name: shape for name, (shape, _) in spec.items()})
    if fingerprint != want:
        raise PayloadError(
            f"layout fingerprint mismatch: payload 0x{fingerprint:08x}, expected 0x{want:08x} for the "
            f"{len(spec)} expected arrays (built for different array names or shapes)"
        )
    stream = version >= 4 and mode == "int4"
    per_record = stream and version >= 5
    if stream and not per_record:
        lengths = unpack_lengths(r.take(table_size(), "code-length table"), HUFFMAN_SYMBOLS, "code-length table")
    out: dict[str, np.ndarray] = {}
    waiting: list[tuple[str, np.ndarray, float, np.ndarray]] = []  # int4 records whose values come in the stream
    for name in sorted(spec):
        shape, numel = spec[name]
        where = f"tensor {name!r}"
        count = r.varint(f"{where} count")
        if count > numel:
            raise PayloadError(f"{where}: count {count} > numel {numel}")
        if count == 0:
            out[name] = np.zeros(shape, dtype=np.float32)
            continue
        if per_record:
            table = f"{where} code-length table"
            lengths = unpack_lengths(r.take(table_size(), table), HUFFMAN_SYMBOLS, table)
        scale, encoding = r.unpack(_SCALE_ENC, f"{where} scale/encoding")
        _check_scale(scale, count, where)
        if encoding not in _INDEX_ENCODINGS[version]:
            known = {e: INDEX_NAMES[e] for e in _INDEX_ENCODINGS[version]}
            raise PayloadError(f"{where}: unknown index encoding {encoding} (known in version {version}: {known})")
        index_len = r.varint(f"{where} index block length")
        indices = decode_indices(encoding, r.take(index_len, f"{where} index block"), count, numel, where)
        if stream:
            waiting.append((name, indices, scale, lengths))
            continue
        if version >= 3:
            codes = decode_codes_v3(r, count, mode, where)
        else:
            codes = decode_codes(r.take(codes_size(mode, count), f"{where} value block"), count, mode, where)
        if version >= 4 and not codes.all():
            raise PayloadError(f"{where}: a zero code is sent (version 4 leaves them out)")
        out[name] = _dense(indices, codes, scale, mode, shape, numel, where)
    if stream:
        block = r.take(len(r.data) - r.pos, "value stream")
        if per_record:
            runs = [(lengths, indices.size, f"value stream, tensor {name!r}") for name, indices, _, lengths in waiting]
        else:
            runs = [(lengths, sum(w[1].size for w in waiting), "value stream")]
        codes = _decode_value_stream(block, runs)
        for name, indices, scale, _ in waiting:
            shape, numel = spec[name]
            out[name] = _dense(indices, codes[: indices.size], scale, mode, shape, numel, f"tensor {name!r}")
            codes = codes[indices.size :]
    return out


def _decode_value_stream(block: bytes, runs: list[tuple[np.ndarray, int, str]]) -> np.ndarray:
    """The int4 codes of a value stream (versions 4 and 5): one sign bit per value, then
    each run's ``count`` Huffman codewords of magnitudes 1..7 with its own code lengths
    (version 4: one run for the payload; version 5: one per record), then fewer than 8
    zero bits."""
    where = "value stream"
    count = sum(n for _, n, _ in runs)
    if count == 0:
        stray = [lengths.tolist() for lengths, _, _ in runs if lengths.any()]
        if block or stray:
            raise PayloadError(f"{where}: no values are sent, but the stream has {len(block)} bytes "
                               f"and the table lengths {stray}")
        return np.zeros(0, dtype=np.int8)
    bits = np.unpackbits(np.frombuffer(block, dtype=np.uint8), bitorder="little")
    if bits.size < count:
        raise PayloadError(f"{where}: {bits.size} bits, fewer than the {count} sign bits")
    end, symbols = count, []
    for lengths, n, run_where in runs:
        run, used = decode_huffman(bits[end:], lengths, n, run_where)
        symbols.append(run)
        end += used
    if bits.size - end >= 8 or bits[end:].any():
        raise PayloadError(f"{where}: {bits.size - end} bits after the last value (padding must be under a byte of zeros)")
    magnitudes = (np.concatenate(symbols) + 1).astype(np.int8)
    return np.where(bits[:count] == 1, -magnitudes, magnitudes).astype(np.int8)


def _decode_v1(r: Reader, spec: dict, mode: str) -> dict[str, np.ndarray]:
    (num_tensors,) = r.unpack(_U32, "tensor count")
    if num_tensors > len(spec):
        raise PayloadError(f"payload declares {num_tensors} tensors, expected {len(spec)}")
    out: dict[str, np.ndarray] = {}
    for i in range(num_tensors):
        (name_len,) = r.unpack(_U16, f"tensor {i} name length")
        raw = r.take(name_len, f"tensor {i} name")
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise PayloadError(f"tensor {i}: name is not valid UTF-8 ({err.reason})") from None
        where = f"tensor {name!r}"
        if name not in spec:
            raise PayloadError(f"{where}: not an expected tensor name")
        if name in out:
            raise PayloadError(f"{where}: appears twice")
        shape, size = spec[name]
        numel, count, scale, encoding = r.unpack(_TENSOR_FIXED, f"{where} numel/count/scale/encoding")
        if numel != size:
            raise PayloadError(f"{where}: numel {numel} != expected {size} for shape {shape}")
        if count > numel:
            raise PayloadError(f"{where}: count {count} > numel {numel}")
        _check_scale(scale, count, where)
        if encoding not in _INDEX_ENCODINGS[1]:
            known = {e: INDEX_NAMES[e] for e in _INDEX_ENCODINGS[1]}
            raise PayloadError(f"{where}: unknown index encoding {encoding} (known in version 1: {known})")
        (index_len,) = r.unpack(_U32, f"{where} index block length")
        index_block = r.take(index_len, f"{where} index block")
        (value_len,) = r.unpack(_U32, f"{where} value block length")
        want = codes_size(mode, count)
        if value_len != want:
            raise PayloadError(f"{where}: value block is {value_len} bytes, expected {want} for {count} {mode} values")
        value_block = r.take(value_len, f"{where} value block")
        indices = decode_indices(encoding, index_block, count, numel, where)
        out[name] = _dense(indices, decode_codes(value_block, count, mode, where), scale, mode, shape, numel, where)
    return out


# --------------------------------------------------------------------------- Flower record


def to_record(payload: bytes):
    """A ``flwr.app.ConfigRecord`` ``{"payload": bytes}`` (ConfigRecord values may be bytes
    in flwr 1.42). The payload's own header names its format and version; records written
    with wire formats 1-4 also carried them as ``"format"`` and ``"version"`` keys, which
    :func:`from_record` still reads (they cost 30 bytes a reply)."""
    from flwr.app import ConfigRecord  # Flower only where a payload is packed into a record

    if not isinstance(payload, (bytes, bytearray)):
        raise TypeError(f"payload must be bytes, got {type(payload).__name__}")
    if len(payload) < 5 or bytes(payload[:4]) != MAGIC or payload[4] not in VERSIONS:
        raise ValueError(f"Invalid payload: no {MAGIC!r} header of a known version {VERSIONS}")
    return ConfigRecord({PAYLOAD_KEY: bytes(payload)})


def from_record(record) -> bytes:
    """The payload bytes of a record made by :func:`to_record` (or the older record with
    ``"format"`` and ``"version"`` keys, which must agree with the payload's header);
    PayloadError otherwise. The header itself is checked by :func:`decode`."""
    if not isinstance(record, Mapping):
        raise PayloadError(f"compressed update must be a ConfigRecord, got {type(record).__name__}")
    keys = set(record)
    if keys not in ({PAYLOAD_KEY}, {FORMAT_KEY, VERSION_KEY, PAYLOAD_KEY}):
        raise PayloadError(f"record keys {sorted(keys)} != {[PAYLOAD_KEY]} "
                           f"(or {sorted({FORMAT_KEY, VERSION_KEY, PAYLOAD_KEY})})")
    payload = record[PAYLOAD_KEY]
    if not isinstance(payload, bytes):
        raise PayloadError(f"record payload must be bytes, got {type(payload).__name__}")
    if FORMAT_KEY in keys:
        if record[FORMAT_KEY] != FORMAT:
            raise PayloadError(f"record format {record[FORMAT_KEY]!r} != {FORMAT!r}")
        version = record[VERSION_KEY]
        if type(version) is not int or version not in VERSIONS:
            raise PayloadError(f"record version {version!r} not in {VERSIONS}")
        if len(payload) >= 5 and payload[:4] == MAGIC and payload[4] != version:
            raise PayloadError(f"record version {version} != payload {payload[4]} (the header's version)")
    return payload
