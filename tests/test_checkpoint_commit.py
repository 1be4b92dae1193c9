"""Checkpoints a crash cannot tear: kill -9 at every filesystem step of a save and its commit on
2 real gloo ranks, then a resume to the weights of a run nothing happened to; a damaged newest
checkpoint passed over loudly; a real full disk; uploads and hashes off the training thread;
run directories that a probe or a prune cannot steal; serving environments built under a lock."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch

from flyscale.train.checkpoint import Checkpointer
from flyscale.train.checkpoint_files import MANIFEST, CheckpointError, NoIntactCheckpoint, complete_checkpoints
from flyscale.train.distributed import DistContext
from flyscale.train.run_dirs import claimed_directory, is_held, prune, run_directory
from flyscale.train.state import Position
from tests.conftest import REPO
from tests.test_recovery import _saved, _state

# -- kill -9 anywhere in a commit --------------------------------------------------------------


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    """tests/commit_faults.py's campaign on 2 ranks: every kill point, each resumed to the end."""
    out = tmp_path_factory.mktemp("faults")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.commit_faults", str(out), "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return out, json.loads((out / "report.json").read_text())


@pytest.mark.timeout(420)
@pytest.mark.slow
def test_a_kill_at_any_point_of_a_commit_resumes_to_identical_weights(campaign):
    out, report = campaign
    ref = torch.load(out / "ref" / "weights.pt", weights_only=True)
    cases = report["cases"]
    identical = 0
    for case in cases:
        assert case["killed"] == -9, case  # the kill happened at that point, before the save ended
        assert case["resumed"] == 0, case
        mine = torch.load(case["weights"], weights_only=True)
        identical += all(torch.equal(mine[k], ref[k]) for k in ref)
    events = [e for listing in report["events"].values() for e in listing]
    assert len(cases) == len(events)
    print(f"kill points in a commit tried / resumed to identical weights: {len(cases)} / {identical}")
    assert identical == len(cases)
    # Killed before its rename, step 4 is not there and the resume is from step 2; after, from 4.
    # Where step 4 was damaged and being replaced, the resume said that it fell back.
    for c in cases:
        assert c["step"] in (2, 4), c
        if c["campaign"] == "replace" and c["step"] == 2:
            assert "fell back from damaged step 4" in c["source"], c
    # A step being replaced is there, under its name or put aside, at every point of the commit.
    for c in cases:
        if c["campaign"] == "replace":
            assert {"step-000000004", "step-000000004.old"} & set(c["left"]), c
    # Between the two renames of a replacement only the put-aside copy is there, and it is found.
    aside = [c for c in cases if c["left"] == ["step-000000002", "step-000000004.old", "step-000000004.partial"]]
    assert aside, "no kill landed between the two renames"
    # The points that matter are among them: before and after each rename of the commit (the
    # step put aside, the new one put in place), before each fsync, inside the prune; on both ranks.
    tried = {(c["campaign"], c["rank"], c["event"]) for c in cases}
    for point in [
        ("new", 0, "os.rename step-000000004.partial/manifest.json.tmp -> step-000000004.partial/manifest.json"),
        ("new", 0, "os.rename step-000000004.partial -> step-000000004"),
        ("replace", 0, "os.rename step-000000004 -> step-000000004.old"),
        ("replace", 0, "os.rename step-000000004.partial -> step-000000004"),
        ("replace", 0, "shutil.rmtree step-000000004.old"),
        ("new", 0, "open ."),  # the parent's fsync after the rename
        ("new", 0, "shutil.rmtree step-000000002"),  # the prune (keep=1)
        ("new", 1, "os.rename step-000000004.partial/rank-1.pt.tmp -> step-000000004.partial/rank-1.pt"),
        ("new", 1, "open step-000000004.partial/state/__1_0.distcp"),
    ]:
        assert point in tried, point


@pytest.mark.slow
def test_each_rank_hashes_what_it_wrote_and_the_manifest_names_every_file(campaign):
    out, _ = campaign
    (step,) = complete_checkpoints(out / "ref" / "ckpt")
    listed = set(json.loads((step / MANIFEST).read_text())["files"])
    on_disk = {str(p.relative_to(step)) for p in step.rglob("*") if p.is_file() and p.name != MANIFEST}
    assert listed == on_disk and "state/__1_0.distcp" in listed


# -- a damaged newest checkpoint ---------------------------------------------------------------


def test_a_damaged_newest_checkpoint_is_passed_over_loudly_and_none_whole_is_retryable(tmp_path, caplog):
    from flytekit.exceptions.user import FlyteRecoverableException

    from flyscale.cluster.exit_codes import PERMANENT, RETRYABLE, code_for
    from flyscale.cluster.recovery import lost_peers_retryable

    ckpt = _saved(tmp_path, [1, 2, 3])
    two, three = complete_checkpoints(ckpt.root)[1:]
    (three / "state" / "__0_0.distcp").write_bytes(b"torn")
    with caplog.at_level(logging.WARNING):
        position, resumed = ckpt.restore(_state(), DistContext(), "ddp")
    assert position.step == 2 and resumed.source == "local; fell back from damaged step 3"
    assert f"{three}: state/__0_0.distcp is 4 bytes" in caplog.text and "passing over it" in caplog.text
    assert "resuming from step 2" in caplog.text
    # None whole: a fault of the disk or a crash, retryable; named by the user: permanent.
    for step in (two, complete_checkpoints(ckpt.root)[0]):
        (step / MANIFEST).unlink()
    with pytest.raises(FlyteRecoverableException, match=r"no checkpoint of this run is whole.*has no manifest") as no:
        with lost_peers_retryable():
            ckpt.restore(_state(), DistContext(), "ddp")
    assert isinstance(no.value.__cause__, NoIntactCheckpoint) and code_for(no.value) == RETRYABLE
    named = Checkpointer(tmp_path / "mine", resume_from=str(three))
    with pytest.raises(CheckpointError, match=r"state/__0_0.distcp is 4 bytes") as chosen:
        with lost_peers_retryable():
            named.restore(_state(), DistContext(), "ddp")
    assert code_for(chosen.value) == PERMANENT


# -- a full disk -------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_full_disk_fails_the_save_naming_the_directory_and_keeps_the_previous_step(tmp_path):
    """A real full filesystem: a 1 MiB tmpfs, mounted in a user and mount namespace of the child's
    own (no root needed where unprivileged user namespaces are allowed)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("unprivileged user namespaces are not allowed here: no tmpfs to fill")
    script = (
        f"mount -t tmpfs -o size=1m tmpfs {mount} && exec {sys.executable} -m tests.commit_faults full-disk {mount}"
    )
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    for mode in ("sync", "async"):  # async: the write fails in the background, said at the commit
        said = found[mode]
        assert said["error"].startswith("CheckpointWriteError"), said
        assert f"could not be written in {mount / mode}: no space left on device" in said["error"]
        assert f"the previous checkpoint {mount / mode}/step-000000001 is intact" in said["error"]
        assert said["intact"] and said["left"] == ["step-000000001"] and said["restored"] == 1


# -- the mirror's upload, off the training thread ----------------------------------------------


class SlowMirror:
    """A Mirror that copies into a directory once `go` is set (a slow store), or fails."""

    def __init__(self, dest: Path, fail: bool = False):
        self.dest, self.fail, self.go = dest, fail, threading.Event()

    def restore(self) -> Path | None:
        return None

    def save(self, checkpoint: Path) -> None:
        assert self.go.wait(30)
        if self.fail:
            raise ConnectionError("the object store answered 503")
        shutil.copytree(checkpoint, self.dest / checkpoint.name)


def test_the_mirror_upload_runs_beside_training_and_its_failure_is_raised_at_the_next_save(tmp_path):
    mirror = SlowMirror(tmp_path / "up")
    ckpt = Checkpointer(tmp_path / "ckpt", every_steps=1, keep=2, mirror=mirror)
    start = time.perf_counter()
    ckpt.save(_state(), Position(step=1), DistContext(), "ddp")
    assert time.perf_counter() - start < 10 and not (tmp_path / "up").exists()  # returned, upload still waiting
    mirror.go.set()
    ckpt.wait()  # as training ends: the upload done
    assert (tmp_path / "up" / "step-000000001" / MANIFEST).is_file()

    failing = SlowMirror(tmp_path / "up2", fail=True)
    ckpt = Checkpointer(tmp_path / "ckpt2", every_steps=1, keep=2, mirror=failing)
    ckpt.save(_state(), Position(step=1), DistContext(), "ddp")
    failing.go.set()
    with pytest.raises(ConnectionError, match="503") as raised:
        ckpt.save(_state(), Position(step=2), DistContext(), "ddp")
    assert "uploading checkpoint" in str(raised.value.__notes__) and "step-000000001" in str(raised.value.__notes__)
    assert [p.name for p in complete_checkpoints(ckpt.root)] == ["step-000000001"]


# -- run directories: a probe or a prune does not steal one --------------------------------------

HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


@pytest.mark.timeout(120)
def test_a_starting_run_waits_out_a_brief_look_at_its_lock_instead_of_going_apart(tmp_path):
    """Looking at a lock (`is_held`, `prune`) takes it for an instant; here another process holds
    it for 0.5 s, a look on a slow disk: the run starting meanwhile waits and gets the training's
    directory, where its checkpoints are, instead of one of its own."""
    base = tmp_path / "base"
    shared = run_directory(str(base), "k")
    with claimed_directory(str(base), "k", "first") as first:
        Checkpointer(first, every_steps=1).save(_state(), Position(step=3), DistContext(), "ddp")
    looker = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(shared / ".lock"), "0.5"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert looker.stdout.readline() == "held\n"
        start = time.monotonic()
        with claimed_directory(str(base), "k", "second") as got:
            waited = time.monotonic() - start
            assert got == shared and Checkpointer(got).restore(_state(), DistContext(), "ddp")[0].step == 3
    finally:
        looker.kill()
        looker.wait()
    assert 0.2 < waited < 5, waited
    assert sorted(p.name for p in base.iterdir()) == [shared.name]


def test_prune_deletes_only_what_no_run_holds_and_a_run_after_it_starts_in_its_place(tmp_path):
    base = tmp_path / "base"
    held, old = run_directory(str(base), "held"), run_directory(str(base), "old")
    with claimed_directory(str(base), "held", "live"):
        for name in ("old", "held"):
            Checkpointer(run_directory(str(base), name), every_steps=1).save(
                _state(), Position(step=1), DistContext(), "ddp"
            )
        assert prune(str(base), older_than_s=0, now=time.time() + 60) == [old]
        assert held.is_dir() and not old.exists() and is_held(held)
        assert sorted(p.name for p in base.iterdir()) == [held.name]  # nothing of the deletion left
    with claimed_directory(str(base), "old", "later") as again:
        assert again == old and Checkpointer(again).restore(_state(), DistContext(), "ddp") is None


# -- serving environments built under a lock -----------------------------------------------------


def _wheel(where: Path) -> Path:
    """A tiny wheel with a module and a console script: installed by uv from the file, offline."""
    wheel = where / "flyscale_probe-1.0-py3-none-any.whl"
    info = "flyscale_probe-1.0.dist-info"
    files = {
        "flyscale_probe.py": "def main():\n    print('probe ok')\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: flyscale-probe\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/entry_points.txt": "[console_scripts]\nflyscale-probe = flyscale_probe:main\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in {**files, f"{info}/RECORD": record}.items():
            z.writestr(name, text)
    return wheel


BUILD = """
import sys
from pathlib import Path
from flyscale.serving.servers import environment
print(environment([sys.argv[1]], Path(sys.argv[2])))
"""


@pytest.mark.timeout(300)
def test_load_tests_building_one_serving_environment_at_once_share_it(tmp_path):
    wheel, root = _wheel(tmp_path), tmp_path / "envs"
    builds = [
        subprocess.Popen(
            [sys.executable, "-c", BUILD, str(wheel), str(root)], cwd=REPO, stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    pythons = {b.communicate(timeout=240)[0].strip() for b in builds}
    assert [b.returncode for b in builds] == [0, 0, 0] and len(pythons) == 1
    python = Path(pythons.pop())
    # Whole and usable where it was renamed to: its console script finds its python there.
    ran = subprocess.run([str(python.parent / "flyscale-probe")], capture_output=True, text=True, timeout=60)
    assert ran.stdout == "probe ok\n", ran.stderr
    assert sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) == [python.parent.parent.name]
