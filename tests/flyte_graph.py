"""The tasks of a workflow, wherever they sit: at its top, in a sub-workflow, or in a branch of a
`conditional` (every branch, whichever would run)."""

from __future__ import annotations

from collections.abc import Iterator

from flytekit.core.base_task import Task
from flytekit.core.condition import BranchNode


def workflow_tasks(workflow) -> dict[str, Task]:
    """{short task name: task} over every node, branches and sub-workflows included; a map task
    under the name of the task it maps."""
    return {_short(task): task for task in _tasks(workflow)}


def _short(task: Task) -> str:
    mapped = getattr(task, "python_function_task", None)  # an ArrayNodeMapTask
    return (mapped or task).name.rsplit(".", 1)[-1]


def _tasks(workflow) -> Iterator[Task]:
    for node in workflow.nodes:
        yield from _entity(node.flyte_entity)


def _entity(entity) -> Iterator[Task]:
    if isinstance(entity, BranchNode):
        block = entity._ifelse_block  # flytekit keeps a branch's cases here; no public accessor
        for node in [block.case.then_node, *(c.then_node for c in block.other or []), block.else_node]:
            if node is not None:
                yield from _entity(node.flyte_entity)
    elif isinstance(entity, Task):
        yield entity
    else:  # a sub-workflow
        yield from _tasks(entity)
