"""Cache keys hold content, not where a file was written: every task output that holds a file, a
directory or a table carries a content hash (flytekit's HashMethod), and a file taken out of a
record, whose hash flytekit drops, enters its task's key by the sha256 passed beside it. Read from
the real workflows' graphs; the end-to-end proof is tests/test_cache_e2e.py."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Annotated, Union, get_args, get_origin

import pandas as pd
import pytest
from flytekit.core.hash import HashMethod
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile

from flyscale.data import shards
from flyscale.flyte import content
from tests.flyte_graph import workflow_tasks

# Outputs that hold files but carry no content hash, and why that is right.
UNHASHED = {
    # Never cached, and training takes its weights by their sha256 (`start_sha256`, `start` ignored).
    ("check_model", "o0"),
    # Each part carries the stamp of when its task ran, which the combine hands on to the run's
    # cache report: keyed on it, the combine runs again when a part did (its own outputs are hashed).
    ("prepare_shard", "o0"),
}
SHA256_OF = {"onnx_model": "onnx_sha256"}  # an ignored file input -> the input holding its sha256


def _holds_files(t, seen: frozenset = frozenset()) -> bool:
    """Whether a value of type `t` can hold a file, a directory or a table (whose literal is where
    it was written)."""
    origin = get_origin(t)
    if origin is Annotated:
        return _holds_files(get_args(t)[0], seen)
    if origin in (Union, types.UnionType, list, dict, tuple):
        return any(_holds_files(a, seen) for a in get_args(t))
    cls = origin or t
    if isinstance(cls, type) and issubclass(cls, (FlyteFile, FlyteDirectory, pd.DataFrame)):
        return True
    if dataclasses.is_dataclass(cls) and cls not in seen:
        hints = typing.get_type_hints(cls)
        return any(_holds_files(hints[f.name], seen | {cls}) for f in dataclasses.fields(cls))
    return False


def _hashed(t) -> bool:
    return get_origin(t) is Annotated and any(isinstance(a, HashMethod) for a in get_args(t)[1:])


def _bare_file(t) -> bool:
    """A FlyteFile or FlyteDirectory, or None."""
    args = [a for a in get_args(t) if a is not type(None)] if get_origin(t) in (Union, types.UnionType) else [t]
    return len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], (FlyteFile, FlyteDirectory))


@pytest.fixture(scope="module")
def workflows():
    from workflows.data import prepare_data
    from workflows.scaling import scaling_study
    from workflows.search import hyperparameter_search
    from workflows.train import training_pipeline

    return [training_pipeline, prepare_data, hyperparameter_search, scaling_study]


@pytest.fixture(scope="module")
def tasks(workflows):
    """Every task of the workflows, and those their @dynamic tasks call."""
    from tasks.data import by_content
    from tasks.scaling import subset_examples, subset_train, training_task
    from tasks.train import train_model

    found = {name: t for wf in workflows for name, t in workflow_tasks(wf).items()}
    for t in (by_content, subset_train, subset_examples, training_task(2), train_model):
        found[t.name.rsplit(".", 1)[-1]] = t
    return found


def test_every_output_that_holds_files_carries_a_content_hash(tasks):
    unhashed = {
        (name, output)
        for name, t in tasks.items()
        for output, python_type in t.python_interface.outputs.items()
        if _holds_files(python_type) and not _hashed(python_type)
    }
    assert unhashed == UNHASHED


def test_a_file_input_of_a_cached_task_enters_its_key_by_sha256(tasks):
    """A bare file input is a field taken out of a record: flytekit keys it by its URI, so the task
    ignores it and takes its sha256 beside it."""
    checked = 0
    for name, t in tasks.items():
        if not t.metadata.cache:
            continue
        inputs = t.python_interface.inputs
        for var, python_type in inputs.items():
            if _bare_file(python_type):
                checked += 1
                assert var in t.metadata.cache_ignore_input_vars, f"{name}({var}) is keyed on where its file was"
                sha = SHA256_OF.get(var, f"{var}_sha256")
                assert inputs.get(sha) is str, f"{name}({var}) has no {sha} input to key on"
    assert checked >= 2  # the tokenizer into training (its bundle carries it on), the ONNX file into quantization


def _attribute_bindings(workflow):
    """(task, input) of every task input bound to a field of another node's output, branches and
    sub-workflows included."""
    from flytekit.core.base_task import Task
    from flytekit.core.condition import BranchNode

    def nodes(entity):
        if isinstance(entity, BranchNode):
            block = entity._ifelse_block  # flytekit keeps a branch's cases here; no public accessor
            for node in [block.case.then_node, *(c.then_node for c in block.other or []), block.else_node]:
                if node is not None:
                    yield node
                    yield from nodes(node.flyte_entity)
        elif not isinstance(entity, Task) and hasattr(entity, "nodes"):
            for node in entity.nodes:
                yield node
                yield from nodes(node.flyte_entity)

    for node in nodes(workflow):
        if isinstance(node.flyte_entity, Task):
            for b in node.bindings:
                if b.binding.promise is not None and b.binding.promise.attr_path:
                    yield node.flyte_entity, b.var


def test_a_field_taken_out_of_a_record_never_keys_a_cached_task_by_where_its_files_are(workflows):
    """flytekit drops a record's content hash when a workflow takes a field out of it
    (`trained.weights`): a field that holds files must be an ignored input of a cached task."""
    for wf in workflows:
        for task, var in _attribute_bindings(wf):
            python_type = task.python_interface.inputs[var]
            if task.metadata.cache and _holds_files(python_type):
                assert var in task.metadata.cache_ignore_input_vars, f"{task.name}({var}) in {wf.name}"


def test_the_same_bytes_anywhere_have_one_content_hash(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for root in (a, b):
        (root / "sub").mkdir(parents=True)
        (root / "sub" / "x.bin").write_bytes(b"\x00" * 10)
        (root / "y.txt").write_text("y")
    assert content.directory_sha256(a) == content.directory_sha256(b)
    assert content.content_hash(FlyteDirectory(str(a))) == content.content_hash(FlyteDirectory(str(b)))
    assert content.content_hash(FlyteFile(str(a / "y.txt"))) == content.content_hash(FlyteFile(str(b / "y.txt")))
    (b / "y.txt").write_text("z")  # another byte: another hash (the file's identity moved with it)
    assert content.directory_sha256(a) != content.directory_sha256(b)
    (b / "y.txt").write_text("y")
    (b / "sub" / "x.bin").rename(b / "sub" / "w.bin")  # the same bytes under another name: another directory
    assert content.directory_sha256(a) != content.directory_sha256(b)


def test_a_split_is_keyed_by_the_hash_it_was_written_with(tmp_path):
    frame = pd.DataFrame({"x": range(100), "label": [i % 3 for i in range(100)]})
    one, two = shards.write(frame, "one"), shards.write(frame, "two")
    assert one.dir.path != two.dir.path
    assert one.sha256 == two.sha256 == content.directory_sha256(one.dir.path)
    assert content.content_hash(one) == content.content_hash(two)
    assert content.content_hash(one) != content.content_hash(shards.write(frame.head(99), "three"))
    # Written as it streams, over several files: the hash is the files', taken as each was closed.
    writer = shards.ShardWriter("streamed", rows_per_file=20, row_group_rows=10, streamed=True)
    for start in range(0, 100, 7):
        writer.write(frame.iloc[start : start + 7])
    streamed = writer.close()
    assert len(shards.files(streamed.dir.path)) == 5
    assert streamed.sha256 == content.directory_sha256(Path(streamed.dir.path))
    # A split without one (from before it was recorded) is hashed from its files.
    assert content.content_hash(dataclasses.replace(one, sha256="")) == content.content_hash(one)


def test_a_value_without_a_canonical_form_is_refused():
    @dataclasses.dataclass
    class Odd:
        x: object

    with pytest.raises(TypeError, match="no content hash for a set"):
        content.content_hash(Odd({1}))


def test_the_model_bundle_is_keyed_by_its_bytes_and_loads_only_the_weights_it_names(tmp_path):
    """Training hands every later stage one ModelBundle: the same weights written to two places
    are one key, another byte is another; `module()` builds the configured model with those
    weights, and refuses a file that is not the one its sha256 names."""
    import torch

    from flyscale.config import DataConfig, ModelConfig, ObjectiveConfig
    from flyscale.data import source
    from flyscale.model import build_model, save_state
    from tasks.records import ModelBundle

    info, cfg = source.info(DataConfig()), ModelConfig()
    torch.manual_seed(0)
    trained = build_model(cfg, info)
    a, b = Path(save_state(trained, "model.pt")), tmp_path / "elsewhere.pt"
    b.write_bytes(a.read_bytes())
    bundle = ModelBundle(FlyteFile(str(a)), content.file_sha256(a), info, cfg, ObjectiveConfig())
    moved = dataclasses.replace(bundle, weights=FlyteFile(str(b)))
    assert content.content_hash(bundle) == content.content_hash(moved)
    loaded = bundle.module()
    assert all(torch.equal(x, y) for x, y in zip(loaded.state_dict().values(), trained.state_dict().values()))
    b.write_bytes(a.read_bytes()[:-1] + bytes([a.read_bytes()[-1] ^ 1]))
    assert content.content_hash(bundle) != content.content_hash(moved)
    with pytest.raises(ValueError, match="not those their sha256 says"):
        moved.module()
