"""The training progress bar: drawn on rank 0 on a terminal, absent in logs and on other ranks."""

from __future__ import annotations

import io

import torch
from rich.console import Console

from flyscale.config import TrainConfig
from flyscale.train.batches import make_loader
from flyscale.train.distributed import DistContext
from flyscale.train.evaluator import evaluate_split
from flyscale.train.progress import train_progress
from flyscale.train.step import make_optimizer, standard_step
from flyscale.train.trainer import fit
from flyscale_plugins.datasets import digits
from flyscale_plugins.models import MLP, MLPOptions


def _terminal() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(force_terminal=True, file=out, width=120), out


def _fit(cfg: TrainConfig, ctx: DistContext) -> None:
    """A real `fit` of a small MLP: 64 rows, batch 16, so 4 steps per epoch."""
    torch.manual_seed(0)
    model = MLP().build(MLPOptions(hidden=[16], dropout=0.0), digits.info(None))
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(64, 64, generator=g) * 16, torch.randint(0, 10, (64,), generator=g)
    dataset = torch.utils.data.TensorDataset(x, y)
    loader = make_loader(dataset, ctx.train_sampler(dataset, seed=0), cfg, ctx)
    optimizer = make_optimizer(model, cfg)
    fit(
        model,
        standard_step(model, optimizer, cfg, ctx.device),
        loader,
        evaluate_split(model, x, y, ctx),
        cfg,
        ctx,
        "ddp",
        optimizer,
    )


def test_bar_is_off_without_a_terminal_and_off_rank_0():
    with train_progress(3, 4, main=True, console=Console(file=io.StringIO())) as bar:
        assert bar is None  # a log file, not a terminal
    console, out = _terminal()
    with train_progress(3, 4, main=False, world_size=2, console=console) as bar:
        assert bar is None  # rank 1 on a terminal still draws nothing
    assert out.getvalue() == ""


def test_bar_on_a_terminal_shows_epochs_steps_and_throughput():
    console, out = _terminal()
    with train_progress(3, 4, main=True, world_size=2, console=console) as bar:
        for _ in range(3):
            bar.start_epoch()
            for _ in range(4):
                bar.step(16)
            bar.end_epoch(1234.0)
    text = out.getvalue()
    assert "epochs" in text and "3/3" in text  # every epoch done
    assert "steps" in text and "4/4" in text  # every step of the last epoch done
    assert "1,234 samples/s" in text


def test_fit_draws_the_bar_only_on_a_terminal(capsys, monkeypatch, caplog):
    cfg = TrainConfig(epochs=3, batch_size=16)
    # fit's own Console writes to sys.stdout; FORCE_COLOR is how rich is told it is a terminal.
    monkeypatch.setenv("FORCE_COLOR", "1")
    _fit(cfg, DistContext())
    drawn = capsys.readouterr().out
    assert "3/3" in drawn and "samples/s" in drawn
    monkeypatch.delenv("FORCE_COLOR")
    monkeypatch.setenv("TTY_COMPATIBLE", "0")  # captured stdout: not a terminal
    caplog.clear()  # count the second run's lines only
    with caplog.at_level("INFO", logger="flyscale.train.loop"):
        _fit(cfg, DistContext())
    assert capsys.readouterr().out == ""  # nothing extra in logs...
    assert sum(r.getMessage().startswith("epoch ") for r in caplog.records) == 3  # ...which keep one line per epoch
