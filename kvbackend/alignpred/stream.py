"""The byte container of an AlignPred page group: named numpy arrays, a header, and a crc32c.

Layout (little endian): ``magic "KVAP" | version u8 | count u16 | entries | crc32c u32`` with each
entry ``name_len u8 | name | dtype u8 | ndim u8 | shape u32 * ndim | payload``. The crc32c covers
every byte before it (header fields included) and is checked before anything else is parsed. No
pickle: the reader accepts only the dtypes listed below and at most ``MAX_NDIM`` axes, and checks
every length against the stream before it slices, so nothing larger than the stream is allocated.

Version 2 streams carry the value checksum of :mod:`.schema`; a stream of any other version is a
:class:`CorruptStream` (a miss), never read by another version's rules.
"""

from __future__ import annotations

import math
import struct

import crc32c
import numpy as np

from kvbackend.errors import CorruptStream  # raised here; defined with the other errors

MAGIC = b"KVAP"
VERSION = 3  # 3: cross-block predictions in exact fixed point (`align.exact_product`), the same on every machine
MAX_NDIM = 4
_DTYPES = [np.dtype(t) for t in ("uint8", "uint16", "uint32", "int32", "int64", "float32", "float64", "float16")]


def pack(arrays: dict[str, np.ndarray]) -> bytes:
    parts = [MAGIC, struct.pack("<BH", VERSION, len(arrays))]
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        if a.ndim > MAX_NDIM:
            raise ValueError(f"entry {name!r} has {a.ndim} axes; a stream holds at most {MAX_NDIM}")
        raw = name.encode()
        parts.append(struct.pack("<B", len(raw)) + raw)
        parts.append(struct.pack(f"<BB{a.ndim}I", _DTYPES.index(a.dtype), a.ndim, *a.shape))
        parts.append(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())
    body = b"".join(parts)
    return body + struct.pack("<I", crc32c.crc32c(body))


def unpack(blob: bytes | memoryview | np.ndarray) -> dict[str, np.ndarray]:
    """Read a stream written by :func:`pack`.

    Raises:
        CorruptStream: wrong magic or version, a checksum mismatch, or lengths that do not add up.
    """
    data = memoryview(blob).cast("B") if not isinstance(blob, bytes) else memoryview(blob)
    if len(data) < 11 or bytes(data[:4]) != MAGIC:
        raise CorruptStream("not an AlignPred stream (bad magic or too short)")
    (crc,) = struct.unpack_from("<I", data, len(data) - 4)
    if crc32c.crc32c(data[:-4]) != crc:
        raise CorruptStream("AlignPred stream checksum mismatch: the stored bytes are damaged")
    version, count = struct.unpack_from("<BH", data, 4)
    if version != VERSION:
        raise CorruptStream(f"AlignPred stream version {version}; this build reads version {VERSION}")
    pos, end, out = 7, len(data) - 4, {}
    try:
        for _ in range(count):
            (n,) = struct.unpack_from("<B", data, pos)
            if pos + 1 + n > end:
                raise CorruptStream("AlignPred stream truncated inside an entry name")
            name = bytes(data[pos + 1 : pos + 1 + n]).decode()
            pos += 1 + n
            if name in out:
                raise CorruptStream(f"AlignPred stream holds entry {name!r} twice")
            code, ndim = struct.unpack_from("<BB", data, pos)
            if code >= len(_DTYPES) or ndim > MAX_NDIM or pos + 2 + 4 * ndim > end:
                raise CorruptStream(f"AlignPred entry {name!r}: dtype code {code}, {ndim} axes, or truncated")
            shape = struct.unpack_from(f"<{ndim}I", data, pos + 2)
            pos += 2 + 4 * ndim
            dtype = _DTYPES[code].newbyteorder("<")
            size = math.prod(shape) * dtype.itemsize  # Python integers: no overflow
            if pos + size > end or math.prod(max(d, 1) for d in shape) > end:  # nor huge axes beside a 0
                raise CorruptStream("AlignPred stream truncated inside an array")
            out[name] = np.frombuffer(data[pos : pos + size], dtype).reshape(shape)
            pos += size
    except (struct.error, UnicodeDecodeError) as exc:
        raise CorruptStream(f"AlignPred stream header unreadable: {exc}") from None
    if pos != end:
        raise CorruptStream("AlignPred stream has trailing bytes")
    return out
