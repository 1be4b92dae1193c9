"""`flyscale checkpoints`: the run folders checkpoints left behind, and old ones pruned; `flyscale
outputs`: what local runs keep of their tasks' files (flyscale/flyte/outputs.py); `flyscale
convert`: a checkpoint's model to Hugging Face safetensors and back (flyscale/train/checkpoint_convert.py);
`flyscale tiny-checkpoint`: a small random Hugging Face checkpoint (flyscale/export/tiny_checkpoint.py)."""

from __future__ import annotations

import argparse


def cmd_checkpoints(args: argparse.Namespace) -> int:
    """List the run directories under the checkpoint base; with --prune-days, delete the old ones."""
    import time

    from flyscale.train.run_dirs import base_directory, prune, run_directories

    base = args.dir or ""
    print(f"checkpoints under {base_directory(base)}")
    if args.prune_days is not None:
        gone = prune(base, args.prune_days * 86400)
        print(f"deleted {len(gone)} run folder(s) not written for {args.prune_days:g} day(s)")
        for path in gone:
            print(f"  {path}")
    runs = run_directories(base)
    for run in runs:
        age_h = (time.time() - run.modified) / 3600
        steps = f"steps {run.steps[0]}..{run.steps[-1]}" if run.steps else "no complete checkpoint"
        held = "  (in use: a run is training in it)" if run.held else ""
        print(f"  {run.path}  {steps}  {run.bytes / 2**20:.1f} MiB  last written {age_h:.1f} h ago{held}")
    if not runs:
        print("  none")
    return 0


def cmd_outputs(args: argparse.Namespace) -> int:
    """How much the local runs' outputs take; with --clear, delete them and empty Flyte's local
    cache, which names them."""
    from flyscale.flyte import outputs

    if args.clear:
        deleted = outputs.clear()
        print(f"deleted {outputs.local_base()} ({deleted / 2**20:.1f} MiB) and emptied Flyte's local cache")
        print("the next local run runs every task again")
    else:
        print(f"local runs' outputs: {outputs.local_base()}, {outputs.size() / 2**20:.1f} MiB")
        print("flyscale outputs --clear deletes them with Flyte's local cache (its entries name them)")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    """A checkpoint's model as Hugging Face safetensors (--to safetensors), or safetensors as a DCP
    directory a run can load (--to dcp)."""
    import sys
    from pathlib import Path

    from flyscale.train import checkpoint_convert
    from flyscale.train.checkpoint_files import CheckpointError

    source, out = Path(args.source), Path(args.out)
    try:
        if args.to == "safetensors":
            files = checkpoint_convert.to_safetensors(source, out)
            print(f"the model of {source} as safetensors in {out}: {', '.join(f.name for f in files)}")
        else:
            checkpoint_convert.from_safetensors(source, out)
            print(
                f"the safetensors of {source} as a DCP directory at {out} (the model under '{checkpoint_convert.MODEL}')"
            )
    except (CheckpointError, OSError, ValueError) as exc:
        print(f"flyscale convert: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_tiny_checkpoint(args: argparse.Namespace) -> int:
    """Save a small random Hugging Face checkpoint, with its tokenizer for a text model."""
    from pathlib import Path

    from flyscale.export import tiny_checkpoint

    out = tiny_checkpoint.make(
        args.arch,
        Path(args.out),
        labels=args.labels,
        image_size=args.image_size,
        channels=args.channels,
        width=args.width,
        layers=args.layers,
        seed=args.seed,
    )
    print(f"wrote a random {args.arch} checkpoint to {out} ({', '.join(sorted(p.name for p in out.iterdir()))})")
    return 0
