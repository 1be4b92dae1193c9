"""The validation report a person would rather look at than read: one self-contained HTML page
(a Flyte Deck, and the same page as an MLflow artifact) with the counts per check, examples of
failing rows, and each feature's distribution in the new data against the reference."""

from __future__ import annotations

import html
import io

import numpy as np
import pandas as pd

from flyscale.data.drift import psi
from flyscale.data.reference import Profile, Reference
from flyscale.data.validation import EXAMPLES, ValidationReport, check_names

PLOTTED = 12  # feature distributions drawn: the most drifted first


def distributions_png(profile: Profile, reference: Reference) -> bytes:
    """Per histogram of the profile (a table's column, an image's channel, ...), the new data's
    share in each bin (bars) against the reference's (line), counted as the data was prepared;
    then the labels. The most drifted come first."""
    from matplotlib.figure import Figure

    ref = reference.profile
    bins = ref.features if ref is not None else profile.features
    names = [n for n in profile.features if n in bins and bins[n].edges == profile.features[n].edges]
    new_counts = {n: profile.features[n].counts for n in names}
    if ref is not None:
        names.sort(key=lambda n: -psi(ref.features[n].counts, new_counts[n]))
    names = names[:PLOTTED]
    cols = 4
    rows = (len(names) + cols) // cols  # one more panel: the labels
    fig = Figure(figsize=(3.0 * cols, 2.2 * rows))
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, name in zip(axes, names):
        _bars(
            ax,
            [str(i) for i in range(len(new_counts[name]))],
            new_counts[name],
            ref.features[name].counts if ref is not None else None,
        )
        ax.set_title(name, fontsize=8)
        ax.set_xticks([])
    classes = sorted(profile.labels, key=int)  # none for examples without a label (a text corpus)
    _bars(
        axes[len(names)],
        classes,
        [profile.labels[c] for c in classes],
        [ref.labels.get(c, 0) for c in classes] if ref is not None else None,
    )
    axes[len(names)].set_title("label", fontsize=8)
    axes[len(names)].legend(fontsize=6)
    for ax in axes[len(names) + 1 :]:
        ax.set_visible(False)
    # Fixed margins for this fixed grid: tight_layout measured every label of 16 panels, which
    # cost more than drawing them (1 s of a validation's 1.7 s).
    fig.subplots_adjust(left=0.035, right=0.99, bottom=0.04, top=0.96, wspace=0.25, hspace=0.4)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()


def _bars(ax, x: list[str], new: list[int], ref: list[int] | None) -> None:
    n = np.asarray(new, dtype=float)
    ax.bar(x, n / max(n.sum(), 1), color="tab:blue", alpha=0.6, label="new")
    if ref is not None:
        r = np.asarray(ref, dtype=float)
        ax.plot(x, r / max(r.sum(), 1), color="tab:orange", marker=".", label="reference")
    ax.tick_params(labelsize=6)


def _table(head: list[str], rows: list[list[str]]) -> str:
    h = "".join(f"<th>{html.escape(c)}</th>" for c in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>"


def validation_html(report: ValidationReport, quarantined: pd.DataFrame, png: bytes) -> str:
    """The whole page: the counts, the checks that failed, examples, drift, the distributions."""
    import base64

    against = f"against {html.escape(report.reference)}" if report.reference else "(no reference yet: the first model)"
    parts = [
        "<h3>Data validation</h3>",
        f"<p>{report.total_rows} rows: {report.valid_rows} valid, {report.quarantined_rows} quarantined "
        f"({report.quarantined_rows / max(report.total_rows, 1):.2%}). Drift measured {against}.</p>",
    ]
    if report.checks:
        parts.append("<h4>Quarantined rows per check</h4>")
        parts.append(
            _table(["check", "rows"], [[k, str(v)] for k, v in sorted(report.checks.items(), key=lambda kv: -kv[1])])
        )
        parts.append("<h4>Examples</h4>")
        rows = []
        for check in sorted(report.checks, key=lambda k: -report.checks[k]):
            hits = quarantined[quarantined["reason"].map(lambda r, c=check: c in check_names(r))].head(EXAMPLES)
            rows += [[check, r.source_file, r.source_row, r.reason] for r in hits.itertuples()]
        parts.append(_table(["check", "file", "row in file", "reason"], rows))
    if report.drift:
        parts.append("<h4>Drift (PSI; under 0.1 stable, over 0.25 a significant shift)</h4>")
        top = sorted(report.drift.items(), key=lambda kv: -kv[1])[:10]
        parts.append(_table(["column", "PSI"], [[k, f"{v:.4f}"] for k, v in top]))
    parts.append("<h4>Distributions: new data (bars) against the reference (line)</h4>")
    parts.append(f'<img alt="distributions" src="data:image/png;base64,{base64.b64encode(png).decode()}"/>')
    return "".join(parts)


def write(report: ValidationReport, quarantined: pd.DataFrame, data_profile: Profile, reference: Reference) -> str:
    """The report as files in a fresh directory (validation.html, distributions.png); returns it."""
    from flyscale.flyte.outputs import output_dir

    out = output_dir("flyscale-validation-")
    png = distributions_png(data_profile, reference)
    (out / "distributions.png").write_bytes(png)
    (out / "validation.html").write_text(validation_html(report, quarantined, png))
    return str(out)
