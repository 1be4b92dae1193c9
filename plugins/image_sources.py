"""Your images, in the three layouts they are usually kept in, on local disk or under an `s3://`
prefix (plugins/sources.py): a folder per class (`image_folder`), WebDataset tar shards
(`webdataset`), and Parquet files as Hugging Face `datasets` exports them (`image_parquet`).

Each hands flyscale every image's bytes exactly as stored, never decoded: flyscale decodes and
checks them itself (the size from the header first), and quarantines an image that does not
decode or is not the declared size, with its origin (`_source_file`, `_source_row`,
`_source_key`). What has no image or no label (a WebDataset sample without its `.png` or its
`.cls`, a `.cls` that is not an integer, a Parquet row whose image or label is null) arrives with
that field null, which flyscale quarantines as missing: it never stops a run, and is never
dropped unseen.

What cannot be read safely is not read, and comes with its reason (`_source_problem`): a file,
tar member or Parquet cell larger than `max_image_bytes`, a tar member that is a link, a device
or a directory where an image or class should be, or whose name points outside the archive
(`../x.png`, `/etc/x.png`). Nothing is ever extracted to disk, and a link is never followed.

Each layout's reader is a module of its own (image_folder, image_webdataset, image_parquet), and
what they share is in image_records; here are the three plugins, as registered.
"""

from __future__ import annotations

from flyscale_plugins.image_folder import FolderOptions, ImageFolder
from flyscale_plugins.image_parquet import ImageParquet, ParquetOptions
from flyscale_plugins.image_records import ImageOptions
from flyscale_plugins.image_webdataset import TarOptions, WebDataset

# The readers and their options, now in their own modules, stay importable from here.
__all__ = [
    "FolderOptions",
    "ImageFolder",
    "ImageOptions",
    "ImageParquet",
    "ParquetOptions",
    "TarOptions",
    "WebDataset",
    "image_folder",
    "image_parquet",
    "webdataset",
]


image_folder = ImageFolder()
webdataset = WebDataset()
image_parquet = ImageParquet()
