"""Tokenization, a versioned step of its own after the documents are prepared and split: the
tokenizer (made, or trained on the training split) is an artifact and part of the cache key of
everything after it."""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Annotated, NamedTuple

from flytekit import HashMethod, task
from flytekit.types.file import FlyteFile

from flyscale.config import TokenizeConfig
from flyscale.data import tokenize
from flyscale.data.shards import Shards
from flyscale.flyte.caching import LIBRARIES, code_cache
from flyscale.flyte.provenance import TaskRun
from tasks.common import SMALL, TASK
from tasks.records import ValidatedData


def _file_sha256(f: FlyteFile) -> str:
    import hashlib

    return hashlib.sha256(Path(f.path).read_bytes()).hexdigest()


class Tokenized(NamedTuple):
    train: Shards
    val: Shards
    test: Shards
    validated: ValidatedData  # its info now the packed sequences'; the tokenizer and its stats beside it
    # Keyed by content downstream: the same tokenizer trained again re-runs nothing after it.
    tokenizer: Annotated[FlyteFile, HashMethod(_file_sha256)]
    runs: list[TaskRun]  # the data tasks' stamps so far, this one's added


@task(cache=code_cache("datasets", libraries=(*LIBRARIES, "tokenizers")), **TASK, requests=SMALL)
def tokenize_text(
    train: Shards, val: Shards, test: Shards, validated: ValidatedData, cfg: TokenizeConfig, runs: list[TaskRun]
) -> Tokenized:
    """Make (byte-level) or train (BPE, on the training split) the tokenizer, and pack each split's
    documents into sequences of `cfg.seq_len` tokens. `runs`: the stamps of the tasks before it."""
    run = TaskRun.start("tokenize_text")
    splits, info, tokenizer_json, stats = tokenize.tokenize(
        {"train": train, "val": val, "test": test}, validated.info, cfg
    )
    path = Path(tempfile.mkdtemp(prefix="flyscale-tokenizer-")) / "tokenizer.json"
    path.write_text(tokenizer_json)
    tokenizer = FlyteFile(str(path))
    done = replace(validated, info=info, tokens=stats, tokenizer=tokenizer)
    return Tokenized(splits["train"], splits["val"], splits["test"], done, tokenizer, [*runs, run.done()])
