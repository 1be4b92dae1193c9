"""The "Learning curves" Deck: a real PNG inline, and the numbers of every epoch."""

from __future__ import annotations

import base64
import re

from flyscale.render.decks import learning_curves_html
from flyscale.train.telemetry import EpochMetrics, TrainHistory


def _history() -> TrainHistory:
    h = TrainHistory(strategy="ddp", world_size=2, diagnosis="input-bound: raise <num_workers>")
    for e in range(4):
        h.epochs.append(
            EpochMetrics(
                epoch=e,
                train_loss=2.0 / (e + 1),
                train_accuracy=0.5 + 0.1 * e,
                val_loss=2.1 / (e + 1),
                val_accuracy=0.45 + 0.1 * e,
                seconds=0.5,
                samples_per_s=4321.0 + e,
                data_wait_fraction=0.42,
            )
        )
    return h


def test_deck_has_an_inline_png_plot():
    html = learning_curves_html(_history())
    match = re.search(r'<img [^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert match, html[:500]
    png = base64.b64decode(match.group(1))
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000  # a drawn figure, not an empty image


def test_deck_shows_the_last_epoch_numbers_and_escapes_text():
    html = learning_curves_html(_history())
    assert "Learning curves" in html
    assert "val loss 0.5250, val accuracy 0.7500" in html  # the last epoch, in the summary line
    assert "<td>4</td><td>0.5000</td><td>0.5250</td>" in html  # and in the per-epoch table
    assert "<td>4324</td><td>42%</td>" in html  # throughput and data wait
    assert "raise &lt;num_workers&gt;" in html  # text from the run is escaped, never markup


def test_deck_without_epochs_says_so():
    assert "No epochs" in learning_curves_html(TrainHistory(strategy="ddp", world_size=1))


def test_the_evaluation_deck_shows_both_models_latency_and_four_plots(tmp_path):
    import torch

    from flyscale.evaluate.comparison import compare
    from flyscale.evaluate.metrics import evaluate
    from flyscale.render import plots
    from flyscale.render.decks import evaluation_html

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    x, y = torch.randn(60, 4), torch.randint(0, 3, (60,))
    fp32 = evaluate(model, x, y, 3)
    int8_model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    int8 = evaluate(int8_model, x, y, 3)
    comparison = compare(model, int8_model, "dynamic_int8", fp32, int8, 4)
    folder = plots.draw_run(str(tmp_path), fp32, int8, comparison, _history())
    # Every figure of the run, once, under the names the MLflow run gives them.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(plots.RUN_PLOTS)
    page = evaluation_html(fp32, int8, comparison, folder)
    pngs = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert [alt for alt, _ in pngs] == ["fp32 confusion", "int8 confusion", "reliability", "latency"]
    # The Deck shows the very files the register task logs, byte for byte.
    shown = [plots.CONFUSION_FP32, plots.CONFUSION_INT8, plots.RELIABILITY, plots.LATENCY]
    assert [base64.b64decode(data) for _, data in pngs] == [(tmp_path / name).read_bytes() for name in shown]
    assert all(base64.b64decode(data)[:8] == b"\x89PNG\r\n\x1a\n" for _, data in pngs)
    assert f"{fp32.accuracy:.4f}" in page and "dynamic_int8" in page
    assert page.count("<li>batch") == 4  # 1, 8, 64, 256, each with both models and the speed-up
