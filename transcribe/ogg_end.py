"""Whether an Ogg file (Vorbis, Opus, FLAC in Ogg) was cut off, or is several joined end to end.

libsndfile takes an Ogg file's length from the granule position of its last whole page and
decodes up to it without complaint, so a half-copied file or a recording whose writer died
decodes as a shorter whole file, and was transcribed "ok". Ogg pages carry their own
length, so a file whose last page is incomplete was cut off.

A last page that is whole but not flagged end-of-stream (EOS) is no verdict: the spec asks
for the flag, but real writers leave it out of whole files. Android's MediaRecorder
(AOSP OggWriter, the OGG output format) never sets it, so every Opus recording it makes
would fail; and a cut that falls exactly between pages is rare (a copy stops at a buffer's
size, not a page's end).

Only the end of the file is read (two pages at most, ~128 KiB). A page is trusted as the
start of the walk only if its CRC checks, so an "OggS" inside packet data cannot start one;
each next page must start exactly where the one before ends. Anything that does not parse
that way (trailing bytes of another kind, say) gives no verdict: the file is read as before.
"""
from __future__ import annotations

import mmap
from pathlib import Path

_HEADER = 27  # bytes before the segment table
_MAX_PAGE = _HEADER + 255 + 255 * 255


def _crc_table() -> list[int]:
    table = []
    for i in range(256):
        r = i << 24
        for _ in range(8):
            r = ((r << 1) ^ 0x04C11DB7) if r & 0x80000000 else r << 1
        table.append(r & 0xFFFFFFFF)
    return table


_TABLE = _crc_table()


def crc(page: bytes) -> int:
    """Ogg's CRC-32 (polynomial 0x04C11DB7, MSB first, no reflection) of a page, taken with
    its checksum field zeroed."""
    value = 0
    for b in page[:22] + b"\0\0\0\0" + page[26:]:
        value = ((value << 8) & 0xFFFFFFFF) ^ _TABLE[(value >> 24) ^ b]
    return value


def _crc_ok(page: bytes) -> bool:
    return crc(page) == int.from_bytes(page[22:26], "little")


def _page_end(buf: bytes, at: int) -> int | None:
    """Where the page starting at `at` ends (may be past the buffer); None if even its header
    and segment table are not all there."""
    if at + _HEADER > len(buf):
        return None
    segments = buf[at + 26]
    if at + _HEADER + segments > len(buf):
        return None
    return at + _HEADER + segments + sum(buf[at + _HEADER: at + _HEADER + segments])


_NO_SYNC = object()


def _walk(buf: bytes, at: int) -> str | None | object:
    """Pages from `at` to the end: None (the last one is whole, or other bytes follow it),
    why it was cut off, or _NO_SYNC (`at` is no page start)."""
    first = True
    while True:
        end = _page_end(buf, at)
        if end is None or end > len(buf):
            return _NO_SYNC if first else "the file ends inside an Ogg page (cut off)"
        if first and (buf[at + 4] != 0 or not _crc_ok(buf[at:end])):
            return _NO_SYNC
        first = False
        if end == len(buf):
            return None  # with or without the EOS flag (see the module's docstring)
        if buf[end:end + 4] != b"OggS":
            # after a page whose CRC checks: bytes of another kind follow the last page (no
            # verdict, and no search from every later "OggS", which is quadratic in pages)
            return None
        at = end


def ogg_cut_off(path: str | Path) -> str | None:
    """Why the Ogg file at `path` looks cut off, or None (whole, or no verdict)."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(max(0, size - 2 * _MAX_PAGE))
        buf = f.read()
    at = buf.find(b"OggS")
    while at != -1:
        verdict = _walk(buf, at)
        if verdict is not _NO_SYNC:
            return verdict
        at = buf.find(b"OggS", at + 1)
    return None


BOS = 0x02  # header-type flag: the first page of a logical stream


def ogg_chained(path: str | Path) -> bool:
    """Whether the Ogg file at `path` holds a second stream after the first one's pages (files
    joined end to end): a page flagged beginning-of-stream after a page that is not. libsndfile
    decodes the first link only, and it does not always say so: a junk warning or an unknown
    length flags some joins, but two copies of one encoder's output, or Opus links, read as
    the first link's length alone, and the rest of the speech was dropped with an "ok".

    The pages are walked by their lengths (the file is mapped, not read into memory); a page
    that is not where the one before ended, and any late BOS page, counts only if its CRC
    checks, so "OggS" inside packet data cannot pass for one."""
    with open(path, "rb") as f:
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (ValueError, OSError):
            return False  # empty, or a file that cannot be mapped: no verdict
    with mm:
        at = expected = 0
        past_headers = False
        while (at := mm.find(b"OggS", at)) != -1:
            end = _page_end(mm, at)
            if end is None or end > len(mm) or mm[at + 4] != 0:
                at += 1
                continue
            late_bos = bool(mm[at + 5] & BOS) and past_headers
            if (at != expected or late_bos) and not _crc_ok(mm[at:end]):
                at += 1
                continue
            if late_bos:
                return True
            past_headers = past_headers or not mm[at + 5] & BOS
            at = expected = end
    return False
