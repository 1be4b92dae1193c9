"""A corpus of hostile inputs, made by code, each prepared through `pyflyte run workflows/data.py
prepare_data` as a user would: decompression bombs, truncated and empty images, a tar holding a
1 GB member (sparse on disk), links, a directory, a name with `..` and an unknown type; a JSONL
with a 50 MB line, bytes that are not UTF-8 and a byte order mark; a text file larger than the
memory the run is allowed. Each is quarantined with its reason or read as it should be; nothing
crashes, the rest is prepared, and the run's peak memory stays under the limit the test sets.
"""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.conftest import BIN, REPO

PREPARE = ("workflows/data.py", "prepare_data")
# The most the whole `pyflyte run` may hold at once (its largest process's peak RSS); the text file
# below is larger, and the 1 GB tar member nearly as large.
MEMORY_LIMIT = 1 << 30


def _png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _declaring(width: int, height: int, fmt: str) -> bytes:
    """An image whose header declares `width` x `height` pixels and holds almost none of them."""
    if fmt == "png":

        def chunk(kind: bytes, body: bytes) -> bytes:
            return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

        header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    from PIL import Image

    out = io.BytesIO()
    Image.new("L", (8, 8)).save(out, format="JPEG", quality=90)
    data = bytearray(out.getvalue())
    sof = data.index(b"\xff\xc0")  # baseline frame header: length (2), precision (1), height (2), width (2)
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def _member(name: str, kind: bytes = tarfile.REGTYPE, size: int = 0, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname = kind, size, link
    return info


def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> None:
    """A tar written header by header; a member given None as its data is left a hole in the file
    (sparse on disk: a 1 GB member costs no disk and no time to write)."""
    with open(path, "wb") as f:
        for info, data in members:
            f.write(info.tobuf(tarfile.GNU_FORMAT))
            if data is None:
                f.seek(info.size + (-info.size) % 512, io.SEEK_CUR)
            else:
                f.write(data + b"\0" * ((-len(data)) % 512))
        f.write(b"\0" * 1024)  # the end of the archive


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    return _member(name, size=len(data)), data


IMAGE_CASES = {  # sample key -> the start of its quarantine reason
    "png-bomb": "image: decodable (got an image of too many pixels to decode (a decompression bomb?)",
    "jpeg-bomb": "image: decodable (got an image of too many pixels to decode (a decompression bomb?)",
    "truncated": "image: decodable (got a PNG that does not decode",
    "empty": "image: decodable (got bytes that are not an image",
    "huge-member": "image: readable (got a tar member (huge-member.png) of 1073741824 bytes, over "
    "data.options.max_image_bytes",
    "symlink": "image: readable (got a symbolic link to '/etc/passwd', not a file: links are never followed",
    "hardlink": "image: readable (got a hard link to 'good-000.png', not a file: links are never followed",
    "directory": "image: readable (got a directory, not a file)",
    "../escape": "image: readable (got the member name '../escape.png', which points outside the archive",
    "unknown": "image: missing (got members .cls, .exe; an image is a .png, .jpg or .jpeg)",
}


@pytest.fixture(scope="module")
def tars(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tars")
    rng = np.random.default_rng(0)
    good = [(f"good-{i:03d}", _png(rng.integers(0, 256, (8, 8), dtype="uint8")), i % 2) for i in range(60)]
    plain = _png(np.zeros((8, 8), "uint8"))
    hostile: list[tuple[tarfile.TarInfo, bytes | None]] = [
        _file("png-bomb.png", _declaring(60_000, 60_000, "png")),
        _file("jpeg-bomb.jpg", _declaring(65_000, 65_000, "jpeg")),
        _file("truncated.png", good[0][1][:-30]),  # its header whole, its pixels cut short
        _file("empty.png", b""),
        (_member("huge-member.png", size=1 << 30), None),
        (_member("symlink.png", tarfile.SYMTYPE, link="/etc/passwd"), b""),
        (_member("hardlink.png", tarfile.LNKTYPE, link="good-000.png"), b""),
        (_member("directory.png", tarfile.DIRTYPE), b""),
        _file("../escape.png", plain),
        _file("unknown.exe", b"MZ\x90\x00"),
        (_member("a-folder", tarfile.DIRTYPE), b""),  # a folder is structure: its samples are read
    ]
    for i, (info, _) in enumerate(hostile[:-1]):
        key = info.name.rsplit(".", 1)[0]
        hostile.insert(2 * i + 1, _file(f"{key}.cls", b"1"))
    _tar(
        root / "shard-0000.tar",
        [
            m
            for key, png, label in good[:30]
            for m in (_file(f"{key}.png", png), _file(f"{key}.cls", str(label).encode()))
        ],
    )
    _tar(
        root / "shard-0001.tar",
        hostile
        + [
            m
            for key, png, label in good[30:]
            for m in (_file(f"a-folder/{key}.png", png), _file(f"a-folder/{key}.cls", str(label).encode()))
        ],
    )
    return root


# Runs a command and writes the peak RSS of the largest process under it (KiB, Linux) to a file.
WRAPPER = (
    "import resource, subprocess, sys; code = subprocess.call(sys.argv[2:]); "
    "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); sys.exit(code)"
)


def _run_measured(home: Path, cfg: dict) -> tuple[subprocess.CompletedProcess, int]:
    """`pyflyte run workflows/data.py prepare_data --cfg CFG` as `run_pipeline` runs it, and the peak
    RSS of its largest process (bytes), measured by a process of its own around it."""
    peak = home / "peak-rss-kib"
    env = {**os.environ, "HOME": str(home), "FLYTE_SDK_LOGGING_LEVEL": "20", "COLUMNS": "400"}
    command = [str(BIN / "pyflyte"), "run", *PREPARE, "--cfg", json.dumps(cfg)]
    result = subprocess.run(
        [sys.executable, "-c", WRAPPER, str(peak), *command],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return result, int(peak.read_text()) * 1024


def _quarantine(stdout: str) -> dict[tuple[str, str], str]:
    """{(file or shard name, key): reason} of what the run quarantined."""
    where = next(line.split(None, 1)[1] for line in stdout.splitlines() if line.startswith("  quarantine "))
    rows = [r for f in sorted(Path(where.strip()).rglob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    return {(Path(r["source_file"]).name, r["source_key"]): r["reason"] for r in rows}


def _tokens(stdout: str) -> bytes:
    """The byte-level tokens of the three splits, end-of-text (256) as NUL."""
    from flyscale.data import shards

    out = b""
    for split in ("train", "val", "test"):
        where = next(line.split()[1] for line in stdout.splitlines() if line.startswith(f"  {split} "))
        t = shards.read_table(where, ["tokens"]).column("tokens").combine_chunks().flatten().to_numpy()
        out += bytes(np.where(t == 256, 0, t).astype("uint8"))
    return out


@pytest.mark.timeout(400)
def test_hostile_images_in_tar_shards_are_quarantined_by_name_and_the_rest_prepared(tmp_path, tars):
    cfg = {
        "data": {
            "dataset": "webdataset",
            "options": {"path": str(tars), "num_classes": 2, "channels": 1, "height": 8, "width": 8},
            "max_quarantine_fraction": 0.5,
        }
    }
    result, peak = _run_measured(tmp_path, cfg)
    assert result.returncode == 0, result.stderr[-3000:]
    found = {key: reason for (shard, key), reason in _quarantine(result.stdout).items()}
    quarantined = {key: found.get(key, "") for key in IMAGE_CASES}
    wrong = {k: v for k, v in quarantined.items() if not v.startswith(IMAGE_CASES[k])}
    assert not wrong, wrong
    assert set(found) == set(IMAGE_CASES)  # nothing else: all 60 good samples (30 in a folder) were kept
    assert "60 valid, 10 quarantined" in result.stdout
    print(
        f"hostile images: {len(IMAGE_CASES)} tried / {len(quarantined)} quarantined by name / 0 crashed; "
        f"peak RSS {peak / 2**20:.0f} MiB (limit {MEMORY_LIMIT / 2**20:.0f})",
        file=sys.stderr,
    )
    assert peak < MEMORY_LIMIT


@pytest.mark.timeout(400)
def test_hostile_text_is_quarantined_by_name_streamed_in_bounded_memory_and_the_rest_prepared(tmp_path):
    from pydoc_data.topics import topics

    data = tmp_path / "docs"
    data.mkdir()
    lines = [line for t in sorted(topics) for line in topics[t].splitlines() if len(line.strip()) > 20]
    (data / "corpus.txt").write_text("\n".join(dict.fromkeys(lines[:600])))
    jsonl = [
        b'\xef\xbb\xbf{"text": "a first record after a byte order mark"}',
        b'{"text": "' + b"y" * (50 << 20) + b'"}',
        b'{"text": "caf\xe9 written in latin-1"}',
        b'{"text": "a last record that is fine"}',
    ]
    (data / "records.jsonl").write_bytes(b"\n".join(jsonl))
    big = data / "larger-than-memory.txt"
    with open(big, "wb") as f:  # 1.5 GB of one line (NULs, sparse on disk): over the limit and the cap
        f.truncate(MEMORY_LIMIT * 3 // 2)
    cfg = {
        "data": {"dataset": "text", "options": {"path": str(data), "document": "line"}, "max_quarantine_fraction": 0.5},
        "tokenize": {"seq_len": 32},
    }
    result, peak = _run_measured(tmp_path, cfg)
    assert result.returncode == 0, result.stderr[-3000:]
    cap = "over data.options.max_document_bytes 16777216: not read)"
    size = big.stat().st_size
    assert _quarantine(result.stdout) == {
        ("records.jsonl", "line 2"): f"text: size (got a line of {len(jsonl[1])} bytes, {cap}",
        ("records.jsonl", "line 3"): "text: utf8 (got byte 13 is not UTF-8)",
        # the file was read as ranges of 256 MB, each a shard; the first holds its one line
        (f"larger-than-memory.txt#bytes=0-{256 << 20}", "byte 0"): f"text: size (got a line of {size} bytes, {cap}",
    }
    # the record after the byte order mark was kept, without it (packing may drop the end of a
    # split, under seq_len tokens: the record's first 8 bytes are always there)
    stream = _tokens(result.stdout)
    assert b"a first " in stream and b"\xef\xbb\xbf" not in stream
    print(
        f"hostile text: 4 tried / 3 quarantined by name, 1 read as it should be / 0 crashed; "
        f"peak RSS {peak / 2**20:.0f} MiB (limit {MEMORY_LIMIT / 2**20:.0f})",
        file=sys.stderr,
    )
    assert peak < MEMORY_LIMIT
