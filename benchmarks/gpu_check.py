"""The GPU check: flyscale's training stage on one CUDA device, over NCCL, in fp32, fp16 and bf16,
under ddp and fsdp.

    .venv/bin/python -m benchmarks.gpu_check [--out gpu-check.json]

Unattended on a GPU machine (a few minutes at most). For each model (the default digits MLP and
the CNN preset, configs/digits-cnn.yaml) and each precision it trains as the training task does,
without MLflow and checkpoints: the configured strategy (`ddp`) from the registry, on the
preset's data, split and augmentation, with `train.precision` set: fp32, fp16 (autocast and
GradScaler) and bf16 (autocast, where `torch.cuda.is_bf16_supported()`). It prints the device
and the torch/CUDA/NCCL versions, each run's throughput (samples/s, the median epoch after the
first), and fails (exit 1) when a loss is not finite, the validation accuracy is below `--min-accuracy`, or autocast did not run in the
precision asked for. Without a CUDA device it prints one line saying it skipped, and exits 0.

flyscale wraps the model in DDP only when there is a peer to synchronise with: at world size 1
`process_group()` creates no group and the strategy trains the bare model. So that one GPU
exercises what a multi-GPU job runs, the check makes a real world-size-1 process group (NCCL on
CUDA) and hands the strategy a context that counts as distributed: the model goes into
DistributedDataParallel (device_ids, gradient buckets, the timed comm hook), or is sharded by
FSDP2 over a mesh of that one device (built on the meta device, its shards materialised there,
all-gathers and reduce-scatters through NCCL; in bf16, FSDP2's policy gathers and computes bf16
parameters and reduces fp32 gradients), and every epoch's metrics are reduced through the
process group's collectives. It uses the first GPU only.

At the presets' batch of 32 the digits models are small enough that a GPU step is bound by
kernel launches and Python, so samples/s there measures per-step overhead more than the device;
a larger `--batch-size` shows more of the device (give it more `--epochs`: fewer steps learn less).

`--device cpu --backend gloo` runs the same path on CPU, for tests here: fp32 and bf16 (a
correctness path on CPU, slow), while fp16 is reported as CUDA-only (flyscale refuses it
there) rather than run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from torch import nn

from flyscale import model as artifacts
from flyscale.config import PipelineConfig, from_dict
from flyscale.data import source as data
from flyscale.data.augment import augment
from flyscale.data.prepare import prepare_table, prepared_frames
from flyscale.train import distributed, strategies, trainer
from flyscale.train.batches import TrainData, train_data
from flyscale.train.distributed import DistContext
from flyscale.train.loop import TrainingDiverged

REPO = Path(__file__).resolve().parents[1]
PRESETS = {"mlp": None, "cnn": REPO / "configs" / "digits-cnn.yaml"}  # None: the defaults (digits MLP)
PRECISIONS = ("fp32", "fp16", "bf16")
STRATEGIES = ("ddp", "fsdp")
AUTOCAST_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class OneRankGroup(DistContext):
    """Rank 0 of a world-size-1 process group that counts as distributed: the strategy wraps the
    model in DDP and reduces metrics through the group, as it would with peers."""

    @property
    def distributed(self) -> bool:
        return dist.is_initialized()


@contextlib.contextmanager
def one_rank_group(device: torch.device, backend: str, timeout_s: float) -> Iterator[OneRankGroup]:
    """A real process group of one rank on `device`, its store on a free loopback port."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs = {"device_id": device} if backend == "nccl" else {}  # NCCL makes its communicator now
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=timeout)  # port 0: the OS picks
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout, **kwargs)
    ctx = OneRankGroup(device=device)
    distributed.configure_logging(ctx)  # flyscale's per-epoch log lines, as in the training task
    try:
        yield ctx
    finally:
        dist.destroy_process_group()


def environment(device: torch.device) -> dict:
    """What ran: the device and the versions that matter for it."""
    env = {
        "device": str(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "backend": dist.get_backend() if dist.is_initialized() else None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            device_name=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            nccl=nccl_version(),
            cudnn=torch.backends.cudnn.version(),
            bf16_supported=torch.cuda.is_bf16_supported(),
        )
        with contextlib.suppress(TypeError):  # torch >= 2.4 counts emulated bf16 as supported unless asked not to
            env["bf16_native"] = torch.cuda.is_bf16_supported(including_emulation=False)
    else:
        env.update(device_name=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return env


def nccl_version() -> str:
    version = torch.cuda.nccl.version()  # a tuple in recent torch, an int such as 2708 in old ones
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def preset(name: str) -> PipelineConfig:
    path = PRESETS[name]
    return from_dict(yaml.safe_load(path.read_text()) if path else {})


def prepare(cfg: PipelineConfig, max_train_rows: int) -> tuple[TrainData, object]:
    """The preset's training and validation data, as the data stages make them (split, then augment)."""
    frame, info = data.load(cfg.data)
    train, val, _ = prepared_frames(prepare_table(frame, cfg.data, info))
    train = augment(train, info, cfg.augment)
    if max_train_rows:
        train = train.sample(n=min(max_train_rows, len(train)), random_state=cfg.data.seed)
    return train_data(train, val, info), info


def unsupported(precision: str, device: torch.device) -> str:
    """Why this device cannot run `precision` ("" when it can)."""
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return (
            f"bf16 is not supported on {torch.cuda.get_device_name(device)} (torch.cuda.is_bf16_supported() is False)"
        )
    return ""


def watch_compute_dtype(model: nn.Module) -> tuple[set, dict]:
    """The dtypes the Linear/Conv layers compute in during training: each layer's hook records its
    first training forward and removes itself, so the timed epochs run without hooks."""
    seen: set = set()

    def hook(module, _inputs, output):
        if module.training:
            seen.add(str(output.dtype).removeprefix("torch."))
            handles.pop(module).remove()

    handles = {
        m: m.register_forward_hook(hook)
        for m in model.modules()
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))
    }
    return seen, handles


def strategy_config(cfg, strategy: str, precision: str):
    """`cfg.train` under `strategy`: fsdp in bf16 gathers and computes its parameters in bf16
    (FSDP2's mixed-precision policy) and reduces gradients in fp32."""
    if strategy == "ddp":
        return cfg
    bf16 = {"param_dtype": "bf16", "reduce_dtype": "fp32"} if precision == "bf16" else {}
    return dataclasses.replace(cfg, strategy=strategy, options=bf16)


def train_one(
    model_name: str, cfg: PipelineConfig, prepared, precision: str, ctx: DistContext, args, strategy_name: str = "ddp"
) -> dict:
    """One training run through the configured strategy; its throughput and checks."""
    train_cfg = dataclasses.replace(
        strategy_config(cfg.train, strategy_name, precision),
        epochs=args.epochs,
        precision=precision,
        **({"batch_size": args.batch_size} if args.batch_size else {}),
    )
    d, info = prepared
    row = {
        "model": model_name,
        "precision": precision,
        "strategy": train_cfg.strategy,
        "epochs": train_cfg.epochs,
        "batch_size": train_cfg.batch_size,
        "train_rows": len(d.y_train),
    }
    reason = unsupported(precision, ctx.device)
    if strategy_name == "fsdp" and precision == "fp16":
        reason = (
            "fsdp mixes precision through FSDP2's policy (fp32 or bf16 parameters); fp16 with a GradScaler is ddp's"
        )
    if reason:
        return {**row, "status": "unsupported", "reason": reason}
    torch.manual_seed(train_cfg.seed)  # as the training task does: the same initial weights on every rank
    model = artifacts.build_model(cfg.model, info, meta=strategies.wants_meta_model(train_cfg))
    strategy, options = strategies.strategy(train_cfg)
    seen, handles = watch_compute_dtype(model)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    start = time.perf_counter()
    try:
        result = trainer.train(strategy, model, d, train_cfg, ctx, options)
    except TrainingDiverged as exc:
        return {**row, "status": "failed", "reason": str(exc)}
    except ValueError as exc:
        if precision == "fp16" and ctx.device.type != "cuda" and "fp16" in str(exc):  # refused, as it should be
            return {**row, "status": "unsupported", "reason": f"fp16 with GradScaler is CUDA-only: flyscale says {exc}"}
        raise
    finally:
        for h in list(handles.values()):
            h.remove()
    if precision == "fp16" and ctx.device.type != "cuda":
        return {**row, "status": "failed", "reason": f"flyscale trained fp16 on {ctx.device} instead of refusing it"}
    epochs = result.history.epochs
    timed = epochs[1:] or epochs  # the first epoch pays for warm-up (kernels, allocator, autotuning)
    last = epochs[-1]
    row.update(
        samples_per_s=round(statistics.median(m.samples_per_s for m in timed), 1),
        seconds=round(time.perf_counter() - start, 2),
        train_loss=last.train_loss,
        val_loss=last.val_loss,
        val_accuracy=last.val_accuracy,
        peak_memory_mb=round(last.peak_memory_mb, 1),
        compute_dtype=sorted(seen),
        # DDP's timed comm hook saw gradient all-reduces: the model was wrapped and synchronised.
        grad_comm_fraction=round(max(m.grad_comm_fraction for m in epochs), 4),
    )
    problems = check(row, epochs, precision, args.min_accuracy, strategy_name)
    return {**row, "status": "failed" if problems else "ok", **({"reason": "; ".join(problems)} if problems else {})}


def check(row: dict, epochs: list, precision: str, min_accuracy: float, strategy: str = "ddp") -> list[str]:
    """What is wrong with a finished run ([] when nothing)."""
    problems = []
    bad = [m.epoch + 1 for m in epochs if not (math.isfinite(m.train_loss) and math.isfinite(m.val_loss))]
    if bad:
        problems.append(f"loss not finite in epoch(s) {bad}")
    if not row["val_accuracy"] >= min_accuracy:
        problems.append(f"validation accuracy {row['val_accuracy']:.4f} < {min_accuracy} after {len(epochs)} epochs")
    want = str(AUTOCAST_DTYPE[precision]).removeprefix("torch.")
    if row["compute_dtype"] != [want]:
        problems.append(
            f"train.precision={precision} but the layers computed in {row['compute_dtype'] or 'nothing seen'}, "
            f"expected {want}"
        )
    if strategy == "ddp" and not row["grad_comm_fraction"] > 0:
        problems.append(
            "no gradient all-reduce ran: the strategy did not train the model under DistributedDataParallel"
        )
    return problems


def skip_reason(args) -> str:
    """Why the check cannot run here ("" when it can)."""
    if args.device != "cuda" or torch.cuda.is_available():
        return ""
    if torch.version.cuda is None:
        return f"no CUDA device: torch {torch.__version__} is a CPU-only build"
    return (
        f"no CUDA device: torch {torch.__version__} (CUDA {torch.version.cuda}) sees none "
        "(torch.cuda.is_available() is False)"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="also write the JSON summary here (default: stdout only)")
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cuda (default; skipped when there is none) or cpu, to exercise this path without a GPU",
    )
    p.add_argument(
        "--backend", choices=("nccl", "gloo"), help="process-group backend (default: nccl on cuda, gloo on cpu)"
    )
    p.add_argument("--models", default=",".join(PRESETS), help=f"comma-separated, of {list(PRESETS)}")
    p.add_argument("--precisions", default=",".join(PRECISIONS), help=f"comma-separated, of {list(PRECISIONS)}")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help=f"comma-separated, of {list(STRATEGIES)}")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=0, help="per-step batch (default: the preset's)")
    p.add_argument("--max-train-rows", type=int, default=0, help="train on at most this many rows (0: all)")
    p.add_argument(
        "--min-accuracy", type=float, default=0.9, help="fail a run whose final validation accuracy is lower"
    )
    p.add_argument("--require-cuda", action="store_true", help="fail instead of skipping when there is no CUDA device")
    p.add_argument("--timeout-s", type=float, default=120.0, help="process-group timeout")
    args = p.parse_args(argv)
    args.backend = args.backend or distributed.backend_for(torch.device(args.device))
    if args.backend == "nccl" and args.device != "cuda":
        p.error("--backend nccl needs --device cuda")
    args.models, args.precisions = args.models.split(","), args.precisions.split(",")
    args.strategies = args.strategies.split(",")
    for value, allowed, what in (
        (args.models, PRESETS, "--models"),
        (args.precisions, PRECISIONS, "--precisions"),
        (args.strategies, STRATEGIES, "--strategies"),
    ):
        if not value or set(value) - set(allowed):
            p.error(f"{what}: {','.join(value)} is not a subset of {','.join(allowed)}")
    if args.epochs < 1:
        p.error("--epochs must be >= 1")
    return args


def write(summary: dict, out: Path | None, *, show: bool = True) -> None:
    """The JSON summary on stdout (`show`) and in `out`, when given."""
    text = json.dumps(summary, indent=2)
    if show:
        print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


def report_line(r: dict) -> str:
    head = f"  {r['model']:<4} {r.get('strategy', 'ddp'):<5} {r['precision']:<5}"
    if r["status"] == "unsupported":
        return f"{head} not run: {r['reason']}"
    if "samples_per_s" not in r:
        return f"{head} FAILED: {r['reason']}"
    line = (
        f"{head} {r['samples_per_s']:>10,.0f} samples/s  val_acc {r['val_accuracy']:.4f}  "
        f"loss {r['train_loss']:.4f}  peak {r['peak_memory_mb']:.0f} MiB  computed in {','.join(r['compute_dtype'])}"
    )
    return line + (f"  FAILED: {r['reason']}" if r["status"] == "failed" else "")


def run_all(args: argparse.Namespace, ctx: DistContext) -> list[dict]:
    """Every model x strategy x precision asked for, each printed as it finishes."""
    runs = []
    for name in args.models:
        cfg = preset(name)
        prepared = prepare(cfg, args.max_train_rows)
        for strategy in args.strategies:
            for precision in args.precisions:
                try:
                    r = train_one(name, cfg, prepared, precision, ctx, args, strategy)
                except Exception as exc:  # noqa: BLE001 (unattended: report it, and run the others)
                    traceback.print_exc()
                    r = {
                        "model": name,
                        "strategy": strategy,
                        "precision": precision,
                        "status": "failed",
                        "reason": f"{type(exc).__name__}: {exc}",
                    }
                runs.append(r)
                print(report_line(r), flush=True)
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = skip_reason(args)
    if reason:
        then = "failing, as --require-cuda asks" if args.require_cuda else "nothing ran"
        print(f"gpu_check: skipped: {reason}; {then}")
        write({"status": "skipped", "reason": reason}, args.out, show=False)
        return 1 if args.require_cuda else 0
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    start = time.perf_counter()
    with one_rank_group(device, args.backend, args.timeout_s) as ctx:
        env = environment(device)
        print(
            f"gpu_check: {env['device_name']} ({env['device']}), torch {env['torch']}, CUDA {env['cuda']}, "
            f"NCCL {env.get('nccl', '-')}, backend {env['backend']}, world size 1 ({', '.join(args.strategies)}), "
            f"{args.epochs} epochs",
            flush=True,
        )
        runs = run_all(args, ctx)
    failed = [r for r in runs if r["status"] == "failed"]
    write(
        {
            "status": "failed" if failed else "ok",
            "environment": env,
            "min_accuracy": args.min_accuracy,
            "seconds": round(time.perf_counter() - start, 1),
            "runs": runs,
        },
        args.out,
    )
    if failed:
        print(
            f"gpu_check: FAILED: {len(failed)} of {len(runs)} runs: "
            + "; ".join(f"{r['model']} {r.get('strategy', 'ddp')} {r['precision']}: {r['reason']}" for r in failed),
            file=sys.stderr,
        )
        return 1
    ran = sum(r["status"] == "ok" for r in runs)
    print(f"gpu_check: ok: {ran} runs passed, {len(runs) - ran} not supported here", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
