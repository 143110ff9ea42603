"""Checking encoded JPEG/PNG files in Python before they reach libjpeg.

The decoder of the pre-processing graph (:mod:`quark_onnx.calibration.image_graph`) is
onnxruntime-extensions' ``DecodeImage``. Its JPEG path calls libjpeg's default error handler,
which *terminates the process* on a malformed file and loops forever on a truncated one
(onnxruntime-extensions issue #1094).
:func:`check_encoded_image` therefore walks the marker structure of every file in Python first
and rejects what libjpeg would fail on (no end-of-image marker, bad segment lengths, unknown
markers, unsupported coding such as arithmetic or lossless JPEG, 12-bit or CMYK images,
inconsistent Huffman or quantization tables); a file that passes reaches the decoder, which reports
remaining PNG errors as ordinary exceptions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from quark_onnx.errors import CalibrationError

#: The first bytes of every PNG file.
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# A marker inside entropy-coded data: 0xFF followed by a byte other than 0x00 (stuffing),
# 0xD0-0xD7 (restart markers) or 0xFF (fill).
_SCAN_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
_SOF_SUPPORTED = {0xC0: "baseline", 0xC1: "extended sequential", 0xC2: "progressive"}
_SOF_UNSUPPORTED = {
    0xC3: "lossless",
    0xC5: "differential sequential",
    0xC6: "differential progressive",
    0xC7: "differential lossless",
    0xC9: "arithmetic-coded sequential",
    0xCA: "arithmetic-coded progressive",
    0xCB: "arithmetic-coded lossless",
    0xCD: "differential arithmetic sequential",
    0xCE: "differential arithmetic progressive",
    0xCF: "differential arithmetic lossless",
}
# Segments libjpeg skips: APP0-15, COM, DNL.
_SKIPPED_SEGMENTS = {*range(0xE0, 0xF0), 0xFE, 0xDC}
_MAX_SIDE = 65500  # libjpeg's JPEG_MAX_DIMENSION
_MAX_PIXELS = 100 * 1024 * 1024  # the decoder's limit in current onnxruntime-extensions


class _Bad(Exception):
    """Internal: why an encoded image is rejected."""


def check_encoded_image(data: bytes, name: str = "image") -> str:
    """Return ``"jpeg"`` or ``"png"`` when the decoder can safely be given ``data``.

    JPEG files are walked marker by marker (the entropy-coded data is only scanned for the next
    marker) following libjpeg-turbo's reader, and rejected where libjpeg would stop with a fatal
    error (which exits the process) or wait for more data (which never ends):

    * no end-of-image marker (truncated file), a segment longer than the bytes left, a second
      start-of-image marker, an unknown marker, a scan before the frame header;
    * lossless, arithmetic-coded or hierarchical JPEG; precision other than 8 bits; a component
      count other than 1 or 3 (CMYK is not decoded); zero or too large dimensions; sampling
      factors outside 1..4 or not integral ratios of the largest; more than 10 blocks per MCU;
    * a bad DQT/DHT/DAC/DRI/SOS segment (index, length, values), a scan using a quantization or
      Huffman table that is undefined or whose code lengths over-fill the code space (DC symbols
      above 15 included; tables 0 and 1 default to libjpeg's standard tables), bad progressive
      scan parameters.

    Entropy-coded data itself is not decoded: libjpeg recovers from corrupt data with warnings
    and grey blocks, so a damaged but well-formed file still decodes. PNG files are checked for
    the signature and a non-interlaced ``IHDR`` (the decoder reads rows without de-interlacing);
    libpng reports other PNG errors itself.

    Raises:
        CalibrationError: naming ``name`` and the reason.
    """
    try:
        if data.startswith(PNG_SIGNATURE):
            _check_png(data)
            return "png"
        if data.startswith(b"\xff\xd8"):
            _check_jpeg(data)
            return "jpeg"
        raise _Bad("neither a JPEG (no FF D8 start marker) nor a PNG (no PNG signature)")
    except _Bad as exc:
        raise CalibrationError(f"{name}: cannot be decoded: {exc}") from None


def _check_png(data: bytes) -> None:
    if len(data) < 33 or data[12:16] != b"IHDR":
        raise _Bad("PNG without a complete IHDR header (truncated?)")
    width = int.from_bytes(data[16:20], "big")
    height = int.from_bytes(data[20:24], "big")
    if width == 0 or height == 0 or width * height > _MAX_PIXELS:
        raise _Bad(f"PNG of {width}x{height} pixels (1 to {_MAX_PIXELS} pixels supported)")
    if data[28] != 0:
        raise _Bad("interlaced (Adam7) PNG is not supported by the decoder; save it non-interlaced")


@dataclass
class _JpegState:
    frame: dict[int, tuple[int, int, int]] | None = None  # component id -> (h, v, quant table)
    progressive: bool = False
    quant: set[int] = field(default_factory=set)
    # (class, id) -> table usable; DC/AC tables 0 and 1 start as libjpeg's standard tables.
    huff: dict[tuple[int, int], bool] = field(
        default_factory=lambda: {(k, i): True for k in (0, 1) for i in (0, 1)}
    )
    scans: int = 0


def _check_jpeg(data: bytes) -> None:
    n = len(data)
    pos = 2
    state = _JpegState()
    while True:
        # Next marker; libjpeg skips stray bytes before a marker with a warning, so do we.
        ff = data.find(b"\xff", pos)
        if ff < 0:
            raise _Bad("truncated JPEG: no end-of-image marker (FF D9)")
        pos = ff
        while pos < n and data[pos] == 0xFF:
            pos += 1
        if pos >= n:
            raise _Bad("truncated JPEG: no end-of-image marker (FF D9)")
        marker = data[pos]
        at = pos - 1
        pos += 1
        if marker == 0xD9:
            if state.frame is None or not state.scans:
                raise _Bad("JPEG ends before any image data (no frame or no scan)")
            return
        if marker == 0x00 or 0xD0 <= marker <= 0xD7 or marker == 0x01:
            continue  # stuffed byte, restart marker or TEM outside a scan: libjpeg ignores these
        if marker == 0xD8:
            raise _Bad("invalid JPEG structure: a second start-of-image marker (FF D8)")
        if marker in _SOF_UNSUPPORTED:
            raise _Bad(f"{_SOF_UNSUPPORTED[marker]} JPEG (SOF FF {marker:02X}) is not supported")
        known = (*_SOF_SUPPORTED, 0xC4, 0xCC, 0xDA, 0xDB, 0xDD)
        if marker not in known and marker not in _SKIPPED_SEGMENTS:
            raise _Bad(f"corrupt JPEG: unknown marker FF {marker:02X} at byte {at}")
        if pos + 2 > n:
            raise _Bad(f"truncated JPEG: marker FF {marker:02X} at byte {at} has no length")
        length = int.from_bytes(data[pos : pos + 2], "big")
        if length < 2 or pos + length > n:
            raise _Bad(
                f"truncated or corrupt JPEG: segment FF {marker:02X} at byte {at} has length "
                f"{length} but {n - pos} bytes remain"
            )
        seg = data[pos + 2 : pos + length]
        pos += length
        if marker in _SOF_SUPPORTED:
            if state.frame is not None:
                raise _Bad("JPEG with more than one frame (SOF marker)")
            state.frame = _read_sof(seg)
            state.progressive = marker == 0xC2
        elif marker == 0xC4:
            _read_dht(seg, state)
        elif marker == 0xDB:
            _read_dqt(seg, state)
        elif marker == 0xCC:
            _read_dac(seg)
        elif marker == 0xDD:
            if len(seg) != 2:
                raise _Bad("corrupt JPEG: restart interval segment of the wrong length")
        elif marker == 0xDA:
            _read_sos(seg, state)
            state.scans += 1
            found = _SCAN_MARKER.search(data, pos)
            if found is None:
                raise _Bad("truncated JPEG: image data runs to the end without an FF D9 marker")
            pos = found.start()


def _read_sof(seg: bytes) -> dict[int, tuple[int, int, int]]:
    if len(seg) < 6:
        raise _Bad("corrupt JPEG: frame header too short")
    precision = seg[0]
    height = int.from_bytes(seg[1:3], "big")
    width = int.from_bytes(seg[3:5], "big")
    count = seg[5]
    if len(seg) != 6 + 3 * count:
        raise _Bad("corrupt JPEG: frame header length does not match its component count")
    if precision != 8:
        raise _Bad(f"{precision}-bit JPEG is not supported (8-bit only)")
    if count not in (1, 3):
        kind = "CMYK/YCCK" if count == 4 else f"{count}-component"
        raise _Bad(f"{kind} JPEG is not supported (greyscale or 3-component colour only)")
    if not (0 < width <= _MAX_SIDE and 0 < height <= _MAX_SIDE) or width * height > _MAX_PIXELS:
        raise _Bad(f"JPEG of {width}x{height} pixels (sides 1..{_MAX_SIDE}, <= 100 Mpixel)")
    comps: dict[int, tuple[int, int, int]] = {}
    for i in range(count):
        cid, sampling, table = seg[6 + 3 * i : 9 + 3 * i]
        h, v = sampling >> 4, sampling & 15
        if not (1 <= h <= 4 and 1 <= v <= 4):
            raise _Bad("corrupt JPEG: sampling factors outside 1..4")
        comps[cid] = (h, v, table)
    max_h = max(h for h, _, _ in comps.values())
    max_v = max(v for _, v, _ in comps.values())
    if any(max_h % h or max_v % v for h, v, _ in comps.values()):
        raise _Bad("JPEG with fractional chroma sampling ratios is not supported")
    return comps


def _read_dht(seg: bytes, state: _JpegState) -> None:
    pos = 0
    while len(seg) - pos > 16:
        index = seg[pos]
        counts = seg[pos + 1 : pos + 17]
        total = sum(counts)
        if total > 256 or total > len(seg) - pos - 17:
            raise _Bad("corrupt JPEG: bad Huffman table definition")
        klass, ident = (1, index - 0x10) if index & 0x10 else (0, index)
        if not 0 <= ident <= 3:
            raise _Bad(f"corrupt JPEG: Huffman table index {index:#04x} out of range")
        symbols = seg[pos + 17 : pos + 17 + total]
        # libjpeg checks a table when a scan uses it: canonical codes must fit their lengths.
        valid, code = True, 0
        for bits, count in enumerate(counts, start=1):
            code += count
            if count and code >= (1 << bits):
                valid = False
            code <<= 1
        if klass == 0 and any(s > 15 for s in symbols):
            valid = False
        state.huff[(klass, ident)] = valid
        pos += 17 + total
    if pos != len(seg):
        raise _Bad("corrupt JPEG: Huffman table segment of the wrong length")


def _read_dqt(seg: bytes, state: _JpegState) -> None:
    pos = 0
    while pos < len(seg):
        precision, ident = seg[pos] >> 4, seg[pos] & 15
        pos += 1
        if ident > 3:
            raise _Bad(f"corrupt JPEG: quantization table index {ident} out of range")
        size = 2 if precision else 1  # libjpeg-turbo reads any non-zero precision as 16-bit
        state.quant.add(ident)
        pos += min(64, (len(seg) - pos) // size) * size  # and accepts a short last table


def _read_dac(seg: bytes) -> None:
    if len(seg) % 2:
        raise _Bad("corrupt JPEG: arithmetic-coding table segment of the wrong length")
    for index, value in zip(seg[0::2], seg[1::2], strict=True):
        if (
            index >= 32
            or (index >= 16 and not 1 <= value <= 63)
            or (index < 16 and (value & 15) > (value >> 4))
        ):
            raise _Bad("corrupt JPEG: bad arithmetic-coding table")


def _read_sos(seg: bytes, state: _JpegState) -> None:
    frame, huff, quant = state.frame, state.huff, state.quant
    if frame is None:
        raise _Bad("corrupt JPEG: a scan (SOS) before the frame header (SOF)")
    count = seg[0] if seg else 0
    if not 1 <= count <= 4 or len(seg) != 4 + 2 * count:
        raise _Bad("corrupt JPEG: bad scan header")
    ss, se = seg[1 + 2 * count], seg[2 + 2 * count]
    ah, al = seg[3 + 2 * count] >> 4, seg[3 + 2 * count] & 15
    ids = [seg[1 + 2 * i] for i in range(count)]
    if len(set(ids)) != count or any(c not in frame for c in ids):
        raise _Bad("corrupt JPEG: a scan names a component the frame does not have (or twice)")
    if count > 1 and sum(frame[c][0] * frame[c][1] for c in ids) > 10:
        raise _Bad("JPEG sampling factors too large (more than 10 blocks per MCU)")
    dc_band = ss == 0
    for i, cid in enumerate(ids):
        if frame[cid][2] not in quant:
            raise _Bad(f"corrupt JPEG: quantization table {frame[cid][2]} is used but not defined")
        tables = seg[2 + 2 * i]
        needed = []
        if not state.progressive or (dc_band and ah == 0):
            needed.append((0, tables >> 4))
        if not state.progressive or not dc_band:
            needed.append((1, tables & 15))
        for key in needed:
            if not huff.get(key, False):
                raise _Bad(
                    f"corrupt JPEG: a scan uses {'AC' if key[0] else 'DC'} Huffman table "
                    f"{key[1]}, which is undefined or invalid"
                )
    if state.progressive:
        bad = se != 0 if dc_band else (ss > se or se > 63 or count != 1)
        if bad or (ah != 0 and al != ah - 1) or al > 13:
            raise _Bad("corrupt JPEG: bad progressive scan parameters")
