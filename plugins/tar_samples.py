"""WebDataset tar shards read as a stream of samples, safely: only a sample's image and class
members are read, each only when it is a regular file of at most the cap, named inside the
archive. Nothing is extracted to disk and no link is followed; what is not read is named, for
the sample to be quarantined with that reason (plugins/image_sources.py hands it to flyscale).
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator

from flyscale_plugins import sources

TAR_BUFFER = 8 << 20  # bytes of a tar fetched at a time
IMAGE_TYPES = ("png", "jpg", "jpeg")  # a WebDataset sample's image, by its extension


def too_large(what: str, size: int | None, cap: int) -> str:
    """The reason for an image over the cap (`size` None: only known to be larger)."""
    of = f"{size} bytes" if size is not None else f"more than {cap} bytes"
    return f"image: readable (got {what} of {of}, over data.options.max_image_bytes {cap}: not read)"


SAMPLE_TYPES = {**dict.fromkeys(IMAGE_TYPES, "image"), "cls": "label"}  # the members read, and their field


def samples(source: sources.Source, cap: int) -> Iterator[tuple[str, dict[str, bytes], list[str]]]:
    """A tar's samples in order, streamed: (key, {extension: bytes}, why a member was not read), a
    sample's members being consecutive as WebDataset writes them (`dir/000123.seg.png`: key
    `dir/000123`, extension `seg.png`). Only image and class members are read, each only when it
    is a regular file of at most `cap` bytes named inside the archive; a larger one is skipped
    over in the stream, never held."""
    key: str | None = None
    members: dict[str, bytes] = {}
    problems: list[str] = []
    try:
        # Buffered: unbuffered, every 10 kB tarfile asks for is a GET of its own on S3 (2,000 for 20 MB).
        with sources.filesystem(source.uri).open_input_stream(source.path, buffer_size=TAR_BUFFER) as stream:
            with tarfile.open(fileobj=stream, mode="r|") as tar:
                for member in tar:
                    folder, _, name = member.name.rpartition("/")
                    stem, _, extension = name.partition(".")
                    extension = extension.lower()
                    if name.startswith(".") or (member.isdir() and extension not in SAMPLE_TYPES):
                        continue  # hidden files (macOS's "._000123.png" shadows), and folders: structure
                    if key is not None and key != f"{folder}/{stem}".lstrip("/"):
                        yield key, members, problems
                        members, problems = {}, []
                    key = f"{folder}/{stem}".lstrip("/")
                    if extension not in SAMPLE_TYPES:
                        members.setdefault(extension, b"")  # ignored, but named if the sample has no image
                    elif problem := _unsafe(member, SAMPLE_TYPES[extension], cap):
                        problems.append(problem)
                    else:
                        members[extension] = tar.extractfile(member).read()  # type: ignore[union-attr]
    except OSError as exc:
        raise sources.readable(exc, source.uri, "reading") from exc
    except tarfile.TarError as exc:
        raise ValueError(
            f"{source.uri} is not a readable tar file ({exc}): rewrite it, or remove it from path"
        ) from exc
    if key is not None:
        yield key, members, problems


def _unsafe(member: tarfile.TarInfo, field: str, cap: int) -> str:
    """Why an image or class member is not read ("" when it is read)."""
    if member.name.startswith("/") or ".." in member.name.split("/"):
        return f"{field}: readable (got the member name {member.name!r}, which points outside the archive: not read)"
    if member.issym() or member.islnk():
        link = "a symbolic" if member.issym() else "a hard"
        return f"{field}: readable (got {link} link to {member.linkname!r}, not a file: links are never followed)"
    if not member.isfile():
        return f"{field}: readable (got a {'directory' if member.isdir() else 'device or pipe'}, not a file)"
    if member.size > cap:
        return too_large(f"a tar member ({member.name})", member.size, cap).replace("image:", f"{field}:", 1)
    return ""


def sample_problem(members: dict[str, bytes], problems: list[str]) -> str | None:
    """Why the sample cannot be used, beyond a null field: its members not read, or no image among
    members of other types."""
    if problems:
        return "; ".join(problems)
    if not any(t in members for t in IMAGE_TYPES) and set(members) - {"cls"}:
        found = ", ".join(f".{t}" for t in sorted(members))
        return f"image: missing (got members {found}; an image is a .png, .jpg or .jpeg)"
    return None


def class_of(data: bytes | None) -> int | None:
    """A `.cls` member's class; None when it is absent or not an int64, for flyscale to quarantine."""
    try:
        value = int(data.decode("ascii").strip()) if data is not None else None
    except (UnicodeDecodeError, ValueError):
        return None
    return value if value is not None and -(2**63) <= value < 2**63 else None
