"""What a run of several ranks needs of its checkpoint directory: failures every rank meets
together, and one directory every rank sees.

- A rank that fails between collectives must stop the others: a rank left alone in a collective
  waits out `recovery.collective_timeout_s` and then reports its peers lost (a retryable fault)
  instead of the failure. `together` runs a step on every rank, then raises on every rank when
  any rank's step failed.
- Every rank writes its own checkpoint files into one directory and reads them back after a
  restart, so on more than one node that directory must be one volume every node mounts. Nothing
  else would notice that it is not until the first checkpoint, minutes in. `check_shared`
  proves it before training: rank 0 writes a probe file holding a random token, every rank reads
  it back, and every rank refuses together (`CheckpointDirNotShared`, a permanent failure: a
  retry would meet the same mounts).
"""

from __future__ import annotations

import pickle
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from flyscale import settings
from flyscale.train.checkpoint_files import CheckpointError

if TYPE_CHECKING:
    from flyscale.train.distributed import DistContext

T = TypeVar("T")

PROBE = ".shared-probe-"  # + the token: a name no earlier probe (or a cache of one) has had


class CheckpointDirNotShared(CheckpointError):
    """recovery.checkpoint_dir is not one volume every rank sees: a permanent failure."""


def together(ctx: DistContext, step: Callable[[], T]) -> list[T]:
    """`step()` on this rank, then every rank's result, in rank order (one all-gather: every rank
    must call it). Where any rank's step raised, every rank raises: that rank its own exception,
    the others the first failed rank's (its type, so the same exit code), noting where it was."""
    try:
        mine: tuple[Any, BaseException | None] = (step(), None)
    except Exception as exc:  # noqa: BLE001 (whatever it is, every rank raises it)
        mine = (None, exc)
    everyone = ctx.all_gather_object((mine[0], _portable(mine[1])))
    if mine[1] is not None:
        raise mine[1]
    failed = [(rank, error) for rank, (_, error) in enumerate(everyone) if error is not None]
    if failed:
        rank, error = failed[0]
        error.add_note(f"(raised on rank {rank}; rank {ctx.rank} stops with it)")
        raise error
    return [value for value, _ in everyone]


def _portable(error: BaseException | None) -> BaseException | None:
    """`error` as it can travel to the other ranks (an exception that does not pickle, as its text)."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 (any exception may fail to pickle, or to unpickle)
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def check_shared(ctx: DistContext, root: Path, checkpoint_dir: str, patience_s: float = 2.0) -> None:
    """Refuse, on every rank together and before anything trains, a run directory `root` in
    which some rank cannot see what rank 0 writes. `checkpoint_dir` is the setting it came from
    (recovery.checkpoint_dir), for the message. A no-op in a single process."""
    if not ctx.distributed:
        return

    def write() -> tuple[str, str, str, str]:
        token = secrets.token_hex(16) if ctx.is_main else ""
        try:
            root.mkdir(parents=True, exist_ok=True)  # every rank: where it will write its own files
            if token:
                (root / f"{PROBE}{token}").write_text(token)
        except OSError as exc:
            raise CheckpointError(
                f"rank {ctx.rank} (host {socket.gethostname()}) cannot write in its checkpoint directory {root} "
                f"(recovery.checkpoint_dir {checkpoint_dir!r}): {exc}"
            ) from exc
        return token, socket.gethostname(), str(root), checkpoint_dir

    # Rank 0's, on every rank: the message is one, from rank 0's view, wherever it is raised.
    token, host0, root0, setting = together(ctx, write)[0]
    probe = root / f"{PROBE}{token}"
    try:
        seen = together(ctx, lambda: (socket.gethostname(), str(probe), _sees(probe, token, patience_s)))
    finally:  # gone when any rank goes on (every rank is here: `together` raised on all or none)
        together(ctx, lambda: probe.unlink(missing_ok=True) if ctx.is_main else None)
    blind = [(rank, host, where, what) for rank, (host, where, what) in enumerate(seen) if what]
    if blind:
        raise CheckpointDirNotShared(_unshared(root0, setting, host0, blind, ctx.world_size))


def _sees(probe: Path, token: str, patience_s: float) -> str:
    """Empty when `probe` holds `token`; else what this rank finds instead (after `patience_s`,
    for a network filesystem that shows a new file late)."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            text = probe.read_text()
            what = "" if text == token else "it holds another token"
        except FileNotFoundError:
            what = "no such file there"
        except OSError as exc:
            what = f"it cannot be read: {exc.strerror}"
        if not what or time.monotonic() >= deadline:
            return what
        time.sleep(0.1)


def _unshared(root: str, checkpoint_dir: str, host0: str, blind: list, world: int) -> str:
    who = "; ".join(f"rank {rank} (host {host}) at {where}: {what}" for rank, host, where, what in blind)
    where = repr(checkpoint_dir) if checkpoint_dir else "'' (~/.flyscale/checkpoints, inside each pod)"
    return (
        f"recovery.checkpoint_dir is not shared by every node of this training: {len(blind)} of {world} "
        f"ranks cannot see the probe file rank 0 (host {host0}) wrote in {root} [{who}]. Every rank writes "
        f"its own checkpoint files into that one directory and reads them back after a restart, so every "
        f"node must mount the same volume there. Mount a ReadWriteMany volume (NFS, EFS, Filestore, CephFS, "
        f"...) at the same path in every training pod and set recovery.checkpoint_dir to that path (now "
        f"{where}). Or train on one node ({settings.NNODES.name}=1 when the workflow is registered), or "
        f"without checkpoints (recovery.checkpoint_every_minutes: 0 and recovery.checkpoint_every_steps: 0; "
        f"a retry then starts afresh). Nothing was trained."
    )
