"""Tokenization, a versioned step of its own after the documents are prepared and split: the
tokenizer (made, or trained on the training split) is an artifact and part of the cache key of
everything after it."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, NamedTuple

from flytekit import task
from flytekit.types.file import FlyteFile

from flyscale.config import TokenizeConfig
from flyscale.data import tokenize
from flyscale.data.shards import ContentShards, Shards
from flyscale.flyte.caching import LIBRARIES, code_cache
from flyscale.flyte.content import BY_CONTENT, file_sha256
from flyscale.flyte.outputs import output_dir
from flyscale.flyte.provenance import TaskRun
from tasks.common import SMALL, TASK
from tasks.records import ValidatedData


# Keyed by content downstream: the same tokenizer trained again, and the same sequences packed
# again, re-run nothing after them.
class Tokenized(NamedTuple):
    train: ContentShards
    val: ContentShards
    test: ContentShards
    # its info now the packed sequences'; the tokenizer, its sha256 and its stats beside it
    validated: Annotated[ValidatedData, BY_CONTENT]
    tokenizer: Annotated[FlyteFile, BY_CONTENT]
    runs: list[TaskRun]  # the data tasks' stamps so far, this one's added


@task(cache=code_cache("datasets", libraries=(*LIBRARIES, "tokenizers")), **TASK, requests=SMALL)
def tokenize_text(
    train: Shards,
    val: Shards,
    test: Shards,
    validated: ValidatedData,
    cfg: TokenizeConfig,
    runs: list[TaskRun],
    pretrained_sha256: str = "",
) -> Tokenized:
    """Make (byte-level) or train (BPE, on the training split) the tokenizer, or load a
    checkpoint's, and pack each split's documents into sequences of `cfg.seq_len` tokens. `runs`:
    the stamps of the tasks before it; `pretrained_sha256`: the checkpoint tokenizer's sha256 when
    the run started (fingerprint_data), which keys this task."""
    run = TaskRun.start("tokenize_text")
    splits, info, tokenizer_json, stats = tokenize.tokenize(
        {"train": train, "val": val, "test": test}, validated.info, cfg
    )
    path = output_dir("flyscale-tokenizer-") / "tokenizer.json"
    path.write_text(tokenizer_json, encoding="utf-8")
    sha256 = file_sha256(path)
    if pretrained_sha256 and sha256 != pretrained_sha256:
        raise ValueError(
            f"the tokenizer of {cfg.tokenizer!r} changed while this run ran (after fingerprint_data read it): "
            "run the same command again"
        )
    tokenizer = FlyteFile(str(path))
    done = replace(validated, info=info, tokens=stats, tokenizer=tokenizer, tokenizer_sha256=sha256)
    return Tokenized(splits["train"], splits["val"], splits["test"], done, tokenizer, [*runs, run.done()])
