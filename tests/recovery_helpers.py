"""Training runs for the recovery tests to kill, stop and resume: real worker processes under
torch-elastic's own launcher, starting workers as flytekit's Elastic task does, real gloo, real signals.

    python -m tests.recovery_helpers OUT STRATEGY NPROC MAX_RESTARTS EVERY_STEPS EPOCHS [DEST [PREV]]

trains digits with STRATEGY on NPROC workers, checkpointing every EVERY_STEPS steps under
OUT/ckpt. With DEST (and PREV) every worker runs inside flytekit's task setup with that
checkpoint destination (and previous attempt's checkpoint): Flyte's checkpoint API as an attempt
on a cluster gets it. FLYSCALE_TEST_TIMEOUT_S sets the collective timeout (default 30 s);
FLYSCALE_TEST_SEED the seed (default 3); FLYSCALE_TEST_CKPT_BASE and FLYSCALE_TEST_OWNER
put the checkpoints under a shared base, in the directory the run claims there;
FLYSCALE_TEST_EPOCH_PAUSE_S pauses rank 0 after each epoch (a run that only has to stay alive,
holding its directory, then leaves the CPUs to the run under test). Rank 0 writes
OUT/weights.pt and OUT/history.json; every worker writes its pid to OUT/pids/rank<R>-restart<N>
so a test knows whom to kill.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path

import torch


def _data():
    from sklearn.datasets import load_digits

    from flyscale.train.batches import TrainData

    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.int64)
    return TrainData(x[:1500], y[:1500], x[1500:], y[1500:])


def train(out: str, strategy: str, every: int, epochs: int, dest: str = "", prev: str = "") -> None:
    import contextlib

    from flyscale.cluster.recovery import FlyteMirror
    from flyscale.config import TrainConfig
    from flyscale.train import trainer
    from flyscale.train.checkpoint import Checkpointer
    from flyscale.train.distributed import process_group
    from flyscale.train.loop import Hooks
    from flyscale.train.run_dirs import restart_directory
    from flyscale_plugins.datasets import digits
    from flyscale_plugins.models import MLP, MLPOptions
    from flyscale_plugins.strategies.ddp import DDPOptions, ddp
    from flyscale_plugins.strategies.fsdp import FSDPOptions, fsdp
    from flyscale_plugins.strategies.pipeline import PipelineOptions, pipeline

    root = Path(out)
    setup = contextlib.nullcontext()
    if dest:
        from flytekit.bin.entrypoint import setup_execution

        setup = setup_execution(
            raw_output_data_prefix=str(root / "raw"), checkpoint_path=dest, prev_checkpoint=prev or None
        )
    with setup, process_group(timeout_s=float(os.environ.get("FLYSCALE_TEST_TIMEOUT_S", "30"))) as ctx:
        pids = root / "pids"
        pids.mkdir(exist_ok=True)
        (pids / f"rank{ctx.rank}-restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}").write_text(
            str(os.getpid())
        )
        seed = int(os.environ.get("FLYSCALE_TEST_SEED", "3"))
        torch.manual_seed(seed - 3)
        # Dropout draws from the RNG every step: an exact resume must put the RNG back too.
        model = MLP().build(MLPOptions(hidden=[64, 32], dropout=0.2), digits.info(None))
        cfg = TrainConfig(strategy=strategy, epochs=epochs, batch_size=16, lr=2e-3, seed=seed, warmup_epochs=0.5)
        fn, options = {
            "ddp": (ddp, DDPOptions()),
            "pipeline": (pipeline, PipelineOptions(microbatches=2)),
            "fsdp": (fsdp, FSDPOptions()),
        }[strategy]
        # FLYSCALE_TEST_CKPT_BASE: a base shared by several runs, in which rank 0 claims the run
        # directory as the training task does: keyed by the training (here its seed), held while
        # it trains, owned by FLYSCALE_TEST_OWNER.
        shared = os.environ.get("FLYSCALE_TEST_CKPT_BASE")
        claim = (
            restart_directory(ctx, shared, f"seed{seed}", os.environ["FLYSCALE_TEST_OWNER"])
            if shared
            else contextlib.nullcontext(root / "ckpt")
        )
        with claim as ckpt_root:
            checkpointer = Checkpointer(
                ckpt_root,
                every_steps=every,
                keep=2,
                mirror=FlyteMirror.current(keep=2) if dest and ctx.is_main else None,
            )
            pause = float(os.environ.get("FLYSCALE_TEST_EPOCH_PAUSE_S", "0"))
            hooks = Hooks(checkpointer=checkpointer, on_epoch=(lambda _: time.sleep(pause),) if pause else ())
            result = trainer.train(fn, model, _data(), cfg, ctx, options, hooks)
        if ctx.is_main:
            torch.save(result.model.state_dict(), root / "weights.pt")
            h = result.history
            (root / "history.json").write_text(
                json.dumps(
                    {
                        "steps": h.steps,
                        "steps_run": h.steps_run,
                        "resumed_from_step": h.resumed_from_step,
                        "resumed_from": h.resumed_from,
                        "epochs": len(h.epochs),
                        "saved": checkpointer.saved,
                        "train_loss": [m.train_loss for m in h.epochs],
                    }
                )
            )


def main(argv: list[str]) -> None:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    import flyscale.cluster.recovery  # noqa: F401
    import flyscale_plugins.strategies.pipeline  # noqa: F401  imported once, before the workers fork
    from flyscale.cluster.launchers import worker_start_method

    out, strategy, nproc, restarts, every, epochs, *rest = argv
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=int(nproc),
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=int(restarts),
        monitor_interval=0.1,
        start_method=worker_start_method(int(nproc)),
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    elastic_launch(config, train)(out, strategy, int(every), int(epochs), *rest)


if __name__ == "__main__":
    main(sys.argv[1:])
