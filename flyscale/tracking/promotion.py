"""The champion alias, moved: a compare-and-set under a lock held in MLflow itself.

The alias moves only if it still points at the champion the verdict was judged against
(flyscale/tracking/champion.py reads it). Otherwise the candidate is refused, with the reason,
and the run says so. A person's move (`flyscale promote`, `flyscale rollback`) takes the same
lock.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from flyscale.evaluate.gating import ChampionRef
from flyscale.tracking.champion import WEIGHTS_TAG, _missing, current_version
from flyscale.tracking.store import MlflowUnavailable

log = logging.getLogger(__name__)

LOCK_SUFFIX = ".promotion-lock"


@dataclass
class Promotion:
    """Whether the alias moved to this run's versions, and why (or why not)."""

    moved: bool
    reason: str


TOKEN_TAG = "flyscale.lock_token"
LOST_LOCK = (
    "not promoted: this run held {lock!r} longer than mlflow.lock_stale_s ({stale_s:.0f} s) and another run "
    "broke it; refusing to move '{alias}' without it. Rerun to judge against the champion as it is now."
)


@dataclass
class Lock:
    """The promotion lock as its holder knows it: the registered model and the token it wrote."""

    client: Any
    name: str
    token: str

    def held(self) -> bool:
        """Whether the lock is still this holder's (not broken as stale and taken by another run)."""
        return _token_of(self.client, self.name) == self.token

    def release(self) -> None:
        """Delete the lock if it is still ours: a lock broken and taken by another run is theirs."""
        from mlflow.exceptions import MlflowException

        try:
            if self.held():
                self.client.delete_registered_model(self.name)
            else:
                log.warning("%r is no longer this run's (broken as stale): left to its holder", self.name)
        except MlflowException as exc:  # the alias has moved (or not) already: do not undo that over a lock
            log.warning("could not release %r (%s); it is broken when stale (mlflow.lock_stale_s)", self.name, exc)


def _token_of(client, name: str) -> str | None:
    """The token of the lock `name`, or None when there is no lock."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_registered_model(name).tags.get(TOKEN_TAG, "")
    except MlflowException as exc:
        if _missing(exc):
            return None
        raise


@contextlib.contextmanager
def promotion_lock(client, model_name: str, timeout_s: float, stale_s: float) -> Iterator[Lock]:
    """Mutual exclusion for moving the alias, held in MLflow so that it spans machines.

    Creating a registered model is atomic (a second create of the same name fails), so the lock is
    a registered model named `<model>.promotion-lock`, tagged with its holder's own token. A lock
    older than `stale_s` was left by a run that died holding it, and is broken. MLflow has no
    compare-and-delete, so every delete reads the token first and deletes only the lock it read:
    the holder its own on release, a breaker the stale one (one breaker per stale lock, by an
    atomic claim). A holder checks `Lock.held()` right before it moves the alias.
    """
    from mlflow.exceptions import MlflowException

    name = model_name + LOCK_SUFFIX
    token = uuid.uuid4().hex
    holder = f"{socket.gethostname()}:{os.getpid()}"
    deadline, said = time.monotonic() + timeout_s, False
    while True:
        try:
            client.create_registered_model(
                name,
                tags={TOKEN_TAG: token, "flyscale.holder": holder, "flyscale.acquired_at": str(time.time())},
                description=f"held by a flyscale run while it moves the alias of {model_name}; deleted on release",
            )
            break
        except MlflowException as exc:
            # MLflow's SQL store, creating a name another run is deleting at that moment, can answer
            # "not found": a contended create, as "already exists" is. Either way, look and retry.
            if exc.error_code != "RESOURCE_ALREADY_EXISTS" and not _missing(exc):
                raise
        if _break_if_stale(client, name, stale_s):
            continue
        if time.monotonic() > deadline:
            raise MlflowUnavailable(
                f"another run holds {name!r} (waited {timeout_s:.0f} s; mlflow.lock_timeout_s). If no run is "
                f"promoting {model_name}, delete that registered model and retry."
            )
        if not said:
            log.warning("waiting for %r: another run is moving the alias of %s", name, model_name)
            said = True
        time.sleep(0.25)
    lock = Lock(client, name, token)
    try:
        yield lock
    finally:
        lock.release()


def _break_if_stale(client, name: str, stale_s: float) -> bool:
    """Delete the lock if it is older than `stale_s`; True when it is gone (broken, or released)."""
    from mlflow.exceptions import MlflowException

    try:
        tags = client.get_registered_model(name).tags
    except MlflowException as exc:
        if _missing(exc):
            return True  # released meanwhile: try again at once
        raise
    acquired = float(tags.get("flyscale.acquired_at", "inf"))
    if time.time() - acquired < stale_s:
        return False
    stale = tags.get(TOKEN_TAG, "")
    # One breaker per stale lock: the claim is another atomic create, named by the stale token.
    claim = f"{name}.breaking.{stale or 'untokened'}"
    try:
        client.create_registered_model(claim, tags={"flyscale.acquired_at": str(time.time())})
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        if not _break_if_stale(client, claim, stale_s):  # another run is breaking it (or died doing so)
            return False
        return _break_if_stale(client, name, stale_s)
    try:
        if _token_of(client, name) == stale:  # still the lock we judged stale: nobody took it since
            log.warning(
                "breaking %r: taken at %s by %s, more than %.0f s ago",
                name,
                acquired,
                tags.get("flyscale.holder"),
                stale_s,
            )
            client.delete_registered_model(name)
    except MlflowException as exc:
        if not _missing(exc):
            raise
    finally:
        with contextlib.suppress(MlflowException):
            client.delete_registered_model(claim)
    return True


def promote(
    client,
    versions: list[tuple[str, str]],
    alias: str,
    judged: ChampionRef,
    candidate_sha256: str,
    lock_timeout_s: float,
    lock_stale_s: float,
    withdrawn: tuple[str, ...] = (),
) -> Promotion:
    """Move `alias` of each (model, version) only if the first model's alias still points at
    `judged` (or at a version with these very weights), and take it off each model `withdrawn`
    (an int8 twin this version has none of). All or none of them move."""
    from mlflow.exceptions import MlflowException

    model_name, version = versions[0]
    with promotion_lock(client, model_name, lock_timeout_s, lock_stale_s) as lock:
        now = current_version(client, model_name, alias)
        now_label = f"v{now.version}" if now is not None else "no champion"
        same = (str(now.version) if now is not None else "") == judged.version
        if not same and not (now is not None and now.tags.get(WEIGHTS_TAG) == candidate_sha256):
            return Promotion(
                False,
                (
                    f"not promoted: '{alias}' moved from {judged.label()} to {now_label} while this run was being "
                    f"judged against {judged.label()}; refusing rather than promoting on a stale verdict. Rerun to "
                    f"judge against {now_label}."
                ),
            )
        if not lock.held():
            return Promotion(False, LOST_LOCK.format(lock=lock.name, stale_s=lock_stale_s, alias=alias))
        moved: list[tuple[str, str | None]] = []
        try:
            for name, v in versions:
                before = current_version(client, name, alias)
                client.set_registered_model_alias(name, alias, v)
                moved.append((name, str(before.version) if before is not None else None))
            for name in withdrawn:
                before = current_version(client, name, alias)
                if before is not None:
                    client.delete_registered_model_alias(name, alias)
                    moved.append((name, str(before.version)))
        except MlflowException:
            for name, before in moved:  # all or none: put back what this loop already moved
                with contextlib.suppress(MlflowException):
                    if before is None:
                        client.delete_registered_model_alias(name, alias)
                    else:
                        client.set_registered_model_alias(name, alias, before)
            raise
    return Promotion(True, f"'{alias}' moved from {judged.label()} to v{version}")


def move_alias(
    client,
    model_name: str,
    alias: str,
    to_version: str,
    action: str,
    who: str,
    why: str,
    lock_timeout_s: float = 120.0,
    lock_stale_s: float = 600.0,
) -> str:
    """Point `alias` of the model, and of its int8 twin, at `to_version` (a person's decision:
    `flyscale rollback` or `flyscale promote`), under the promotion lock; who and why are recorded
    as tags on the version and on the model. Returns what happened, in words."""
    from mlflow.exceptions import MlflowException

    if not why.strip():
        raise ValueError(f"say why you {action} (--reason): it is recorded with the alias move")
    try:
        client.get_registered_model(model_name)
    except MlflowException as exc:
        if not _missing(exc):
            raise
        names = sorted(m.name for m in client.search_registered_models())
        close = difflib.get_close_matches(model_name, names, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(
            f"there is no registered model {model_name!r}; {hint}registered: {', '.join(names) or 'none'}"
        ) from None
    try:
        target = client.get_model_version(model_name, to_version)
    except MlflowException as exc:
        if not _missing(exc):
            raise
        have = sorted((str(v.version) for v in client.search_model_versions(f"name = '{model_name}'")), key=int)
        raise ValueError(
            f"{model_name!r} has no version {to_version!r}; its versions: {', '.join(have) or 'none'}"
        ) from None
    moves = [(model_name, str(target.version))]
    run_id = target.tags.get("flyscale.run_id") or target.run_id
    twins = client.search_model_versions(f"name = '{model_name}-int8' and tags.`flyscale.run_id` = '{run_id}'")
    if twins:
        moves.append((f"{model_name}-int8", str(twins[0].version)))
    with promotion_lock(client, model_name, lock_timeout_s, lock_stale_s) as lock:
        before = current_version(client, model_name, alias)
        if not lock.held():
            raise ValueError(LOST_LOCK.format(lock=lock.name, stale_s=lock_stale_s, alias=alias))
        note = (
            f"{action} by {who} at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}: '{alias}' "
            f"from {f'v{before.version}' if before is not None else 'no version'} to v{target.version}: {why}"
        )
        for name, version in moves:
            client.set_registered_model_alias(name, alias, version)
            client.set_model_version_tag(name, version, f"flyscale.{action}", note)
            client.set_registered_model_tag(name, "flyscale.last_alias_move", note)
        # A version without an int8 twin (its int8 did not pay): no other version's twin stands beside it.
        withdrawn = not twins and current_version(client, f"{model_name}-int8", alias) is not None
        if withdrawn:
            client.delete_registered_model_alias(f"{model_name}-int8", alias)
    if withdrawn:
        return note + f" ('{alias}' taken off {model_name}-int8: v{target.version} has no int8 twin)"
    return note + (f" (and {moves[1][0]} v{moves[1][1]})" if len(moves) > 1 else "")
