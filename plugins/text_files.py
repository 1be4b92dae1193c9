"""Reading a text or JSONL file a line at a time in bounded memory, whole or one byte range of it:
what lets a 20 GB JSONL be prepared by many shards, none of which holds more than one document.

A range [start, end) owns the lines that start in it (a file's first line starts at 0, every
other one right after a newline), so ranges that tile a file read each line exactly once,
whichever shard reads it. A paragraph (a run of non-blank lines) belongs to the range its first
line starts in, which reads it on past `end` to its last line. A line or paragraph longer than
`cap` bytes is never held: it is read through and handed on as None, with its size, for the
dataset to quarantine with its reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

CHUNK = 4 << 20  # bytes read at a time (on S3, a GET each)
BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark, which some editors put first in a file: not text
BLANK = b" \t\r"  # what a blank line may hold (a CR of a Windows line end, spaces, tabs)


@dataclass
class Piece:
    """A line or a paragraph of a file."""

    offset: int  # its first byte's position in the file
    line: int  # the line it starts on (1-based); 0 where unknown (a range that starts mid-file)
    data: bytes | None  # without its line end; None when longer than the cap
    size: int  # its bytes, line ends between its lines included


def _raw_lines(f: BinaryIO, offset: int, cap: int) -> Iterator[Piece]:
    """Every line from `offset` (where `f` stands) to the end of the file, unnumbered."""
    buf, start, size, over = bytearray(), offset, 0, False
    while chunk := f.read(CHUNK):
        i = 0
        while True:
            j = chunk.find(b"\n", i)
            stop = len(chunk) if j < 0 else j
            size += stop - i
            if not over and len(buf) + stop - i > cap:
                over, buf = True, bytearray()  # read on to its end, holding none of it
            elif not over:
                buf += chunk[i:stop]
            if j < 0:
                break
            yield Piece(start, 0, None if over else bytes(buf), size)
            buf, start, size, over, i = bytearray(), start + size + 1, 0, False, j + 1
    if size:
        yield Piece(start, 0, None if over else bytes(buf), size)


def lines(f: BinaryIO, start: int, end: int | None, cap: int) -> Iterator[Piece]:
    """The lines that start in [start, end) (`end` None: to the end of the file); numbered, and
    the first without a byte order mark, when `start` is 0."""
    if start == 0:
        f.seek(0)
        for number, piece in enumerate(_raw_lines(f, 0, cap), start=1):
            if end is not None and piece.offset >= end:
                return
            if number == 1 and piece.data is not None:
                piece.data = piece.data.removeprefix(BOM)
            piece.line = number
            yield piece
        return
    f.seek(start - 1)
    raw = _raw_lines(f, start - 1, cap)
    next(raw, None)  # the line holding byte start - 1 started before the range: the previous range's
    for piece in raw:
        if end is not None and piece.offset >= end:
            return
        yield piece


def is_blank(piece: Piece) -> bool:
    """A line of only spaces, tabs and a CR; one over the cap counts as text (it is not held)."""
    return piece.data is not None and not piece.data.strip(BLANK)


def paragraphs(f: BinaryIO, start: int, end: int | None, cap: int) -> Iterator[Piece]:
    """The runs of non-blank lines that start in [start, end), each as one Piece: its lines joined
    by the newlines between them (CRs kept, none at either end), None over the cap."""
    after_blank = start == 0 or _blank_before(f, start, cap)
    current: Piece | None = None
    parts: list[bytes] | None = []
    for piece in lines(f, start, None, cap):  # no end: a paragraph is read to its last line
        if is_blank(piece):
            if current is not None:
                yield _joined(current, parts)
                current = None
            after_blank = True
            if end is not None and piece.offset >= end:
                return
            continue
        if current is None:
            if end is not None and piece.offset >= end:
                return  # the next range's
            if not after_blank:
                continue  # the rest of a paragraph that began in the previous range
            current = Piece(piece.offset, piece.line, None, piece.size)
            parts = None if piece.data is None else [piece.data]
        else:
            current.size += 1 + piece.size
            if parts is not None and piece.data is not None and current.size <= cap:
                parts.append(piece.data)
            else:
                parts = None
        after_blank = False
    if current is not None:
        yield _joined(current, parts)


def _joined(p: Piece, parts: list[bytes] | None) -> Piece:
    p.data = None if parts is None else b"\n".join(parts).strip(b"\r\n")
    return p


def _blank_before(f: BinaryIO, start: int, cap: int) -> bool:
    """Whether the line holding byte start - 1 (the one before the range's first line) is blank,
    judged as `is_blank` judges it when the previous range reads it whole."""
    f.seek(start - 1)
    ends_there = f.read(1) == b"\n"
    size, pos = 0, start - 1 if ends_there else start  # its bytes before `pos`, then from `start` on
    while pos > 0:  # backwards, to the newline before it or the file's start
        step = min(CHUNK, pos)
        f.seek(pos - step)
        chunk = f.read(step)
        head = chunk.rsplit(b"\n", 1)[-1]
        size += len(head)
        if head.strip(BLANK) or size > cap:
            return False
        if len(head) < len(chunk):
            break
        pos -= step
    if not ends_there:  # forwards from `start`, to its newline
        f.seek(start)
        while chunk := f.read(CHUNK):
            tail = chunk.split(b"\n", 1)[0]
            size += len(tail)
            if tail.strip(BLANK) or size > cap:
                return False
            if len(tail) < len(chunk):
                break
    return True
