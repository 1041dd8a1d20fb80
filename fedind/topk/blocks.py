"""The byte blocks of a top-k payload, and a bounds-checked reader of it.

Index blocks: the flat indices an array sends, as delta-varints, a bitmap or (version 3) a
Rice code, whichever is smallest. Value blocks: the quantised codes, as int8 bytes, int4
nibbles, sign bits, or (version 3) a sign bit and the few bits each code magnitude needs
above the smallest. Every decoder checks its block and raises :class:`PayloadError` with
the reason. The layouts are specified in :mod:`fedind.topk.codec`.
"""

from __future__ import annotations

import heapq
import math
import struct

import numpy as np

from .selection import LEVELS, SparseTensor

__all__ = ["HUFFMAN_SYMBOLS", "INDEX_BITMAP", "INDEX_NAMES", "INDEX_RICE", "INDEX_VARINT", "PayloadError", "Reader"]

INDEX_VARINT = 1
INDEX_BITMAP = 2
INDEX_RICE = 3  # version 3 only
INDEX_NAMES = {INDEX_VARINT: "delta-varint", INDEX_BITMAP: "bitmap", INDEX_RICE: "Rice"}
RICE_MAX_K = 31
_U8U8 = struct.Struct("<BB")  # value low, width (v3)


class PayloadError(ValueError):
    """A site's compressed payload is malformed; the message says which field and why."""


# --------------------------------------------------------------------------- index blocks


def _varint_lengths(d: np.ndarray) -> np.ndarray:
    n = np.ones(d.shape, dtype=np.int64)
    for j in range(1, 5):
        n += d >= (1 << (7 * j))
    return n


def encode_varints(d: np.ndarray) -> bytes:
    """Unsigned LEB128 of each value of ``d`` (< 2**32), concatenated. Vectorised."""
    d = d.astype(np.uint64, copy=False)
    lengths = _varint_lengths(d)
    out = np.zeros(int(lengths.sum()), dtype=np.uint8)
    starts = np.cumsum(lengths) - lengths
    for j in range(5):
        m = lengths > j
        if not m.any():
            break
        byte = (d[m] >> np.uint64(7 * j)) & np.uint64(0x7F)
        more = (lengths[m] > j + 1).astype(np.uint64) << np.uint64(7)
        out[starts[m] + j] = (byte | more).astype(np.uint8)
    return out.tobytes()


def _index_deltas(indices: np.ndarray) -> np.ndarray:
    d = np.empty(indices.size, dtype=np.uint64)
    if indices.size:
        d[0] = indices[0]
        d[1:] = np.diff(indices)
    return d


def encode_indices(indices: np.ndarray, numel: int, rice: bool = False) -> tuple[int, bytes]:
    """``(encoding, block)``: the smallest of delta-varint, bitmap and (``rice``) Rice
    coding; ties go to varint, then bitmap."""
    deltas = _index_deltas(indices)
    varint_size = int(_varint_lengths(deltas).sum())
    bitmap_size = (numel + 7) // 8
    rice_size, gaps, k = math.inf, None, 0
    if rice and indices.size:
        gaps = np.diff(indices.astype(np.int64), prepend=-1) - 1  # idx[0], then idx[i] - idx[i-1] - 1
        k = _rice_parameter(gaps)
        rice_size = 1 + (_rice_bits(gaps, k) + 7) // 8
    if varint_size <= min(bitmap_size, rice_size):
        return INDEX_VARINT, encode_varints(deltas)
    if bitmap_size <= rice_size:
        bits = np.zeros(numel, dtype=bool)
        bits[indices] = True
        return INDEX_BITMAP, np.packbits(bits, bitorder="little").tobytes()
    return INDEX_RICE, _encode_rice(gaps, k)


def bit_fields(values: np.ndarray, width: int) -> np.ndarray:
    """The low ``width`` bits of each non-negative value, LSB first: ``[n, width]`` of 0/1
    (uint8); ravelled, the bit stream of fixed-width fields that every block here packs."""
    shifts = np.arange(width, dtype=np.uint64)
    return ((np.asarray(values).astype(np.uint64)[:, None] >> shifts) & np.uint64(1)).astype(np.uint8)


def field_values(fields: np.ndarray) -> np.ndarray:
    """The unsigned values (uint64) of ``[n, width]`` LSB-first bit fields: :func:`bit_fields` undone."""
    shifts = np.arange(fields.shape[1], dtype=np.uint64)
    return (fields.astype(np.uint64) << shifts).sum(axis=1, dtype=np.uint64)


def unpacked_fields(block: bytes, count: int, width: int, what: str, where: str) -> np.ndarray:
    """The ``count`` LSB-first ``width``-bit fields of a packed block whose length was
    checked already, as ``[count, width]`` bits (:func:`field_values` reads them); set
    padding bits are a PayloadError naming ``what``."""
    bits = np.unpackbits(np.frombuffer(block, dtype=np.uint8), bitorder="little")
    if bits[count * width :].any():
        raise PayloadError(f"{where}: {what} padding bits are set")
    return bits[: count * width].reshape(count, width)


def _rice_bits(gaps: np.ndarray, k: int) -> int:
    """Bits of the Rice code of ``gaps`` with parameter ``k``: a unary quotient and a stop
    bit per gap, and ``k`` remainder bits."""
    return int((gaps >> k).sum()) + gaps.size * (1 + k)


def _rice_parameter(gaps: np.ndarray) -> int:
    """The ``k`` in ``[0, 31]`` with the fewest bits (the smallest on ties)."""
    top = min(RICE_MAX_K, int(gaps.max()).bit_length())
    return min(range(top + 1), key=lambda k: _rice_bits(gaps, k))


def _encode_rice(gaps: np.ndarray, k: int) -> bytes:
    """Rice index block: ``k`` (1 byte), then the bit stream (LSB first) of every gap's
    ``k``-bit remainder, then every gap's quotient ``q`` as ``q`` zero bits and a one,
    padded with zero bits to a whole byte. Remainders and quotients in separate runs so
    that both sides are vectorised."""
    remainders = bit_fields(gaps, k).ravel()
    quotients = gaps >> k
    unary = np.zeros(int(quotients.sum()) + gaps.size, dtype=np.uint8)
    unary[np.cumsum(quotients + 1) - 1] = 1
    bits = np.concatenate([remainders, unary])
    return bytes([k]) + np.packbits(bits, bitorder="little").tobytes()


def _decode_varint_indices(block: bytes, count: int, numel: int, where: str) -> np.ndarray:
    b = np.frombuffer(block, dtype=np.uint8)
    if count == 0:
        if b.size:
            raise PayloadError(f"{where}: index block has {b.size} bytes but count is 0")
        return np.zeros(0, dtype=np.int64)
    if b.size == 0 or b[-1] & 0x80:
        raise PayloadError(f"{where}: truncated varint at the end of the index block")
    ends = np.flatnonzero(b < 0x80)
    if ends.size != count:
        raise PayloadError(f"{where}: index block holds {ends.size} varints, count is {count}")
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if np.any(lengths > 5):
        raise PayloadError(f"{where}: varint too long ({int(lengths.max())} bytes, at most 5)")
    if np.any((lengths == 5) & (b[ends] > 0x0F)):
        raise PayloadError(f"{where}: varint overflow (value >= 2**32)")
    if np.any((lengths > 1) & (b[ends] == 0)):
        raise PayloadError(f"{where}: non-minimal varint (trailing zero byte)")
    d = np.zeros(count, dtype=np.uint64)
    for j in range(int(lengths.max())):
        m = lengths > j
        d[m] |= (b[starts[m] + j] & 0x7F).astype(np.uint64) << np.uint64(7 * j)
    dup = np.flatnonzero(d[1:] == 0)
    if dup.size:
        raise PayloadError(f"{where}: duplicate (non-increasing) index at position {int(dup[0]) + 1}")
    indices = np.cumsum(d, dtype=np.uint64)  # < count * 2**32 < 2**64: no wrap-around
    if indices[-1] >= numel:
        raise PayloadError(f"{where}: index {int(indices[-1])} out of range for numel {numel}")
    return indices.astype(np.int64)


def _decode_rice_indices(block: bytes, count: int, numel: int, where: str) -> np.ndarray:
    if not block or count == 0:  # an empty record has no index block at all
        raise PayloadError(f"{where}: empty Rice index block or count 0")
    k = block[0]
    if k > RICE_MAX_K:
        raise PayloadError(f"{where}: Rice parameter {k} > {RICE_MAX_K}")
    bits = np.unpackbits(np.frombuffer(block, dtype=np.uint8, offset=1), bitorder="little")
    if bits.size < count * k:
        raise PayloadError(f"{where}: Rice block too short for {count} remainders of {k} bits")
    stops = np.flatnonzero(bits[count * k :])
    if stops.size != count:
        raise PayloadError(f"{where}: Rice block holds {stops.size} quotients, count is {count}")
    if bits.size - count * k - 1 - stops[-1] >= 8:
        raise PayloadError(f"{where}: Rice block has a whole byte of padding (not minimal)")
    quotients = np.diff(stops, prepend=-1) - 1
    if int(quotients.sum()) > numel >> k:  # before shifting: sum(gaps) >= 2**k * sum(q)
        raise PayloadError(f"{where}: Rice gaps run past numel {numel} (index out of range)")
    remainders = field_values(bits[: count * k].reshape(count, k))
    gaps = (quotients.astype(np.uint64) << np.uint64(k)) | remainders
    indices = np.cumsum(gaps + np.uint64(1), dtype=np.uint64) - np.uint64(1)  # < 2**64 by the check above
    if indices[-1] >= numel:
        raise PayloadError(f"{where}: index {int(indices[-1])} out of range for numel {numel}")
    return indices.astype(np.int64)


def _decode_bitmap_indices(block: bytes, count: int, numel: int, where: str) -> np.ndarray:
    expected = (numel + 7) // 8
    if len(block) != expected:
        raise PayloadError(f"{where}: bitmap block is {len(block)} bytes, expected {expected} for numel {numel}")
    bits = np.unpackbits(np.frombuffer(block, dtype=np.uint8), bitorder="little")
    if bits[numel:].any():
        raise PayloadError(f"{where}: bitmap sets bits past numel {numel} (index out of range)")
    indices = np.flatnonzero(bits[:numel])
    if indices.size != count:
        raise PayloadError(f"{where}: bitmap popcount {indices.size} != count {count}")
    return indices.astype(np.int64, copy=False)


def decode_indices(encoding: int, block: bytes, count: int, numel: int, where: str) -> np.ndarray:
    if encoding == INDEX_VARINT:
        return _decode_varint_indices(block, count, numel, where)
    if encoding == INDEX_BITMAP:
        return _decode_bitmap_indices(block, count, numel, where)
    return _decode_rice_indices(block, count, numel, where)


# --------------------------------------------------------------------------- value blocks


def encode_codes(t: SparseTensor) -> bytes:
    if t.mode == "int8":
        return t.codes.tobytes()
    if t.mode == "int4":
        return _pack_nibbles(t.codes)
    return np.packbits(t.codes < 0, bitorder="little").tobytes()


def _pack_nibbles(codes: np.ndarray) -> bytes:
    """int4 codes as 4-bit two's complement, two per byte, low nibble first, padding 0."""
    nibbles = (codes.astype(np.int16) & 0x0F).astype(np.uint8)
    if nibbles.size % 2:
        nibbles = np.append(nibbles, np.uint8(0))
    return (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8).tobytes()


def codes_size(mode: str, count: int) -> int:
    return {"int8": count, "int4": (count + 1) // 2, "sign": (count + 7) // 8}[mode]


def encode_codes_v3(t: SparseTensor) -> bytes:
    """Version-3 values of a linear mode (int8, int4): the smallest magnitude code ``low``
    (1 byte) and the bit ``width`` of ``|code| - low`` (1 byte), then per value its sign
    bit (1 = negative) and ``width`` bits of ``|code| - low`` (LSB first), padded with zero
    bits to a whole byte. Top-k values all lie near the threshold or above it, so their
    codes span few levels (int4: mostly 4 to 7, 3 bits instead of 4). Sign mode: as v2."""
    if t.mode == "sign":
        return encode_codes(t)
    mags = np.abs(t.codes.astype(np.int16))
    low = int(mags.min())
    width = int(mags.max() - low).bit_length()
    bits = np.concatenate([(t.codes < 0)[:, None].astype(np.uint8), bit_fields(mags - low, width)], axis=1)
    return bytes([low, width]) + np.packbits(bits.ravel(), bitorder="little").tobytes()


def decode_codes(value_block: bytes, count: int, mode: str, where: str) -> np.ndarray:
    """int8 codes of a version-1/2 value block whose length was checked already."""
    if mode == "int8":
        codes = np.frombuffer(value_block, dtype=np.int8)
        if np.any(codes == -128):
            raise PayloadError(f"{where}: int8 code -128 out of range [-127, 127]")
        return codes
    if mode == "int4":
        packed = np.frombuffer(value_block, dtype=np.uint8)
        nibbles = np.empty(2 * packed.size, dtype=np.uint8)
        nibbles[0::2], nibbles[1::2] = packed & 0x0F, packed >> 4
        if nibbles[count:].any():
            raise PayloadError(f"{where}: int4 block padding nibble is set")
        nibbles = nibbles[:count]
        if np.any(nibbles == 0x08):
            raise PayloadError(f"{where}: int4 code -8 out of range [-7, 7]")
        return np.where(nibbles >= 8, nibbles.astype(np.int16) - 16, nibbles).astype(np.int8)
    signs = unpacked_fields(value_block, count, 1, "sign block", where)[:, 0]
    return np.where(signs == 1, -1, 1).astype(np.int8)


def decode_codes_v3(r: "Reader", count: int, mode: str, where: str) -> np.ndarray:
    """Reads and checks a version-3 value block (see :func:`encode_codes_v3`)."""
    if mode == "sign":
        return decode_codes(r.take(codes_size(mode, count), f"{where} value block"), count, mode, where)
    levels = LEVELS[mode]
    low, width = r.unpack(_U8U8, f"{where} value low/width")
    if low > levels or width > 7:
        raise PayloadError(f"{where}: value low {low} / width {width} out of range for {mode} (codes in [-{levels}, {levels}])")
    block = r.take((count * (1 + width) + 7) // 8, f"{where} value block")
    fields = unpacked_fields(block, count, 1 + width, "value block", where)
    mags = low + field_values(fields[:, 1:]).astype(np.int16)
    if np.any(mags > levels):
        raise PayloadError(f"{where}: {mode} code magnitude {int(mags.max())} > {levels}")
    if np.any((mags == 0) & (fields[:, 0] == 1)):
        raise PayloadError(f"{where}: negative zero code (sign bit set on magnitude 0)")
    return np.where(fields[:, 0] == 1, -mags, mags).astype(np.int8)


# --------------------------------------------------------------------------- reader


class Reader:
    """Bounds-checked cursor over a payload: every short read is a PayloadError."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int, what: str) -> bytes:
        left = len(self.data) - self.pos
        if n > left:
            raise PayloadError(f"truncated payload: {what} needs {n} bytes at offset {self.pos}, {left} left")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def unpack(self, fmt: struct.Struct, what: str) -> tuple:
        return fmt.unpack(self.take(fmt.size, what))

    def varint(self, what: str) -> int:
        """One minimal unsigned LEB128 varint < 2**32 (at most 5 bytes)."""
        start, value = self.pos, 0
        for j in range(5):
            if self.pos >= len(self.data):
                raise PayloadError(f"truncated payload: {what} varint cut off at offset {self.pos}")
            byte = self.data[self.pos]
            self.pos += 1
            value |= (byte & 0x7F) << (7 * j)
            if not byte & 0x80:
                if j > 0 and byte == 0:
                    raise PayloadError(f"{what}: non-minimal varint (trailing zero byte) at offset {start}")
                if j == 4 and byte > 0x0F:
                    raise PayloadError(f"{what}: varint overflow (value >= 2**32) at offset {start}")
                return value
        raise PayloadError(f"{what}: varint too long (more than 5 bytes) at offset {start}")


# --------------------------------------------------------------------------- Huffman magnitudes (v4)

HUFFMAN_SYMBOLS = 7  # int4 code magnitudes 1..7 (a zero code is not sent)
_LENGTH_BITS = 3  # each code length, 0 (magnitude absent) to 7, in 3 bits


def huffman_lengths(counts: np.ndarray) -> np.ndarray:
    """Code length of each symbol (0 where its count is 0) of a Huffman code for
    ``counts``: the optimal prefix code of the symbols present; a lone symbol gets 1 bit.
    Ties are broken by symbol order, so both sides of a test agree on the code."""
    present = [(int(c), s) for s, c in enumerate(counts) if c > 0]
    lengths = np.zeros(len(counts), dtype=np.int64)
    if len(present) == 1:
        lengths[present[0][1]] = 1
        return lengths
    heap = [(c, i, (s,)) for i, (c, s) in enumerate(present)]
    heapq.heapify(heap)
    tie = len(heap)
    while len(heap) > 1:
        c1, _, a = heapq.heappop(heap)
        c2, _, b = heapq.heappop(heap)
        lengths[list(a + b)] += 1
        heapq.heappush(heap, (c1 + c2, tie, a + b))
        tie += 1
    return lengths


def _canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Canonical codeword of each symbol: by (length, symbol), consecutive values."""
    codes = np.zeros(lengths.size, dtype=np.int64)
    code, previous = 0, 0
    for s in sorted(np.flatnonzero(lengths), key=lambda s: (lengths[s], s)):
        code <<= int(lengths[s]) - previous
        codes[s], previous = code, int(lengths[s])
        code += 1
    return codes


def pack_lengths(lengths: np.ndarray) -> bytes:
    """The code-length table: each length in 3 bits (LSB first), padded to whole bytes."""
    return np.packbits(bit_fields(lengths, _LENGTH_BITS).ravel(), bitorder="little").tobytes()


def table_size(symbols: int = HUFFMAN_SYMBOLS) -> int:
    return (symbols * _LENGTH_BITS + 7) // 8


def unpack_lengths(block: bytes, symbols: int, where: str) -> np.ndarray:
    """The code lengths of a table; a table whose code is over-full (Kraft sum > 1) or
    whose padding bits are set is a PayloadError."""
    lengths = field_values(unpacked_fields(block, symbols, _LENGTH_BITS, "code-length table", where)).astype(np.int64)
    used = lengths[lengths > 0]
    if used.size and (np.ldexp(1.0, -used)).sum() > 1.0:
        raise PayloadError(f"{where}: code lengths {lengths.tolist()} are not a prefix code (Kraft sum > 1)")
    return lengths


def huffman_bits(symbols: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The codewords of ``symbols`` (each most significant bit first), as one bit array."""
    codes, width = _canonical_codes(lengths), int(lengths.max(initial=0))
    if not symbols.size:
        return np.zeros(0, dtype=np.uint8)
    n, c = lengths[symbols], codes[symbols]
    column = np.arange(width)
    bits = (c[:, None] >> np.maximum(n[:, None] - 1 - column, 0)) & 1  # bit j of a codeword, MSB first
    return bits[column < n[:, None]].astype(np.uint8)


def decode_huffman(bits: np.ndarray, lengths: np.ndarray, count: int, where: str) -> tuple[np.ndarray, int]:
    """``(symbols, bits used)``: the first ``count`` codewords of ``bits``. Vectorised:
    the codeword length at every bit position gives each position's successor, and
    pointer doubling finds the ``count`` positions reached from 0. A bit pattern that is
    no codeword, or a stream that ends inside one, is a PayloadError."""
    if count == 0:
        return np.zeros(0, dtype=np.int64), 0
    width = int(lengths.max(initial=0))
    if width == 0:
        raise PayloadError(f"{where}: {count} values but an empty code-length table")
    codes = _canonical_codes(lengths)
    size = bits.size
    window_length = np.zeros(1 << width, dtype=np.int64)  # 0: no codeword starts so
    window_symbol = np.zeros(1 << width, dtype=np.int64)
    for s in np.flatnonzero(lengths):
        lo = int(codes[s]) << (width - int(lengths[s]))
        window_length[lo : lo + (1 << (width - int(lengths[s])))] = lengths[s]
        window_symbol[lo : lo + (1 << (width - int(lengths[s])))] = s
    padded = np.concatenate([bits.astype(np.int64), np.zeros(width, dtype=np.int64)])
    windows = np.zeros(size, dtype=np.int64)
    for j in range(width):
        windows |= padded[j : j + size] << (width - 1 - j)
    length = window_length[windows]
    successor = np.arange(size) + length
    invalid = size + 1  # sentinel: no codeword here, or one that runs past the stream
    successor[(length == 0) | (successor > size)] = invalid
    jump = np.concatenate([successor, [invalid, invalid]])  # from `size` (the end) nothing follows
    steps = np.arange(count + 1)
    at = np.zeros(count + 1, dtype=np.int64)
    j = 0
    while (1 << j) <= count:
        move = ((steps >> j) & 1).astype(bool)
        at[move] = jump[at[move]]
        jump = jump[jump]
        j += 1
    if np.any(at > size):
        first = int(np.flatnonzero(at > size)[0])
        raise PayloadError(f"{where}: value {first} of {count} is no codeword of the table (or the stream ends inside it)")
    return window_symbol[windows[at[:count]]], int(at[count])
