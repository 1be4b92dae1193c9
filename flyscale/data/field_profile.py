"""The profile of typed examples, a handful of histograms per field, summed batch by batch and
shard by shard: what drift is measured on and what the report draws.

- an image (uint8, C x H x W): each channel's intensity histogram (`image[c0]`, ...), and the
  share of saturated values, 0 or 255 (`image[saturated]`: [others, saturated]);
- a document: its length in characters on doubling bins (`text[length]`) and its UTF-8 bytes
  (`text[bytes]`, 256 bins: the byte-level tokenizer's distribution);
- a variable-length sequence: its length (`tokens[length]`);
- any other numeric field with a declared range: its values on 16 bins of the range;
- a scalar number (a table's column): its values (`pixel_3`), on 16 bins of its range where it
  declares one, else on signed half-octaves (TARGET_EDGES), or on the reference's bins when the
  reference profiled the column (a reference recorded before tables were binned so holds the
  deciles of its data);
- the label: counts per class; a real-valued target (regression) instead its values
  (`target[values]`), on 16 bins of its range where it declares one, else on signed
  half-octaves (TARGET_EDGES), and drift is measured on them as on a feature's.

Every histogram has fixed edges, so the counts of any two batches, shards or runs add up and
compare bin for bin (PSI against the champion's profile).
"""

from __future__ import annotations

import numpy as np

from flyscale.data import drift
from flyscale.data.fields import real_target
from flyscale.data.reference import FeatureProfile, Profile
from flyscale.plugin.records import DatasetInfo, FieldSpec

INTENSITY_EDGES = np.arange(11) * 25.6  # ten bins of a uint8 channel: value * 10 // 256
LENGTH_EDGES = np.concatenate([[0], 2.0 ** np.arange(0, 21)])  # 1, 2, 4, ... 1M elements
BYTE_EDGES = np.arange(257) - 0.5
VALUE_BINS = 16
# A target with no declared range: the same edges whatever the data, so that any two profiles
# add up and compare. Half-octaves (x1.41) of magnitude from 2**-10 to 2**30, either side of 0.
_MAGNITUDES = 2.0 ** (np.arange(-20, 61) / 2)
TARGET_EDGES = np.concatenate([-_MAGNITUDES[::-1], [0.0], _MAGNITUDES])


def edges_of(field: FieldSpec) -> dict[str, np.ndarray]:
    """{histogram name: its edges} profiled for `field` (none for a field nothing fits)."""
    if field.dtype == "string":
        return {f"{field.name}[length]": LENGTH_EDGES, f"{field.name}[bytes]": BYTE_EDGES}
    if field.variable:
        return {f"{field.name}[length]": LENGTH_EDGES}
    if field.dtype == "uint8" and len(field.shape) == 3:
        channels = {f"{field.name}[c{c}]": INTENSITY_EDGES for c in range(field.shape[0])}
        return {**channels, f"{field.name}[saturated]": np.array([0.0, 0.5, 1.0])}
    if field.range is not None and field.shape:
        return {f"{field.name}[values]": np.linspace(field.range[0], field.range[1], VALUE_BINS + 1)}
    if not field.shape:
        if field.range is None:
            return {field.name: TARGET_EDGES}
        return {field.name: np.linspace(field.range[0], field.range[1], VALUE_BINS + 1)}
    return {}


def reference_edges(info: DatasetInfo, reference: Profile | None) -> dict[str, list[float]]:
    """The bins the reference profiled each scalar field on: a new batch is counted on them."""
    if reference is None:
        return {}
    scalar = [f.name for f in info.fields if not f.shape and f.dtype != "string" and f.name != info.label_column]
    return {n: list(reference.features[n].edges) for n in scalar if n in reference.features}


def target_edges(field: FieldSpec) -> dict[str, np.ndarray]:
    """{histogram name: its edges} of a real-valued target: its range's, or TARGET_EDGES."""
    if field.range is not None:
        return {f"{field.name}[values]": np.linspace(field.range[0], field.range[1], VALUE_BINS + 1)}
    return {f"{field.name}[values]": TARGET_EDGES}


class Profiler:
    """Counts of every histogram `edges_of` gives, and of the labels (or the values of a
    real-valued target), as batches are added."""

    def __init__(self, info: DatasetInfo, edges: dict[str, list[float]] | None = None):
        self.info = info
        self.fields = [f for f in info.fields if f.name != info.label_column]
        given = edges or {}
        self.edges = {
            f.name: {f.name: np.asarray(given[f.name])} if f.name in given else edges_of(f) for f in self.fields
        }
        self.target = real_target(info)
        if self.target is not None:  # profiled as a feature is: its values, not counts per class
            self.fields.append(self.target)
            self.edges[self.target.name] = target_edges(self.target)
        self.counts: dict[str, np.ndarray] = {}
        self.labels = np.zeros(max(info.num_classes, 0) if self.target is None else 0, dtype="int64")
        self.rows = 0

    def add(self, values: dict[str, np.ndarray], sign: int = 1) -> None:
        """Count a batch's examples (sign -1 takes back examples counted before)."""
        for f in self.fields:
            for name, counts in _histograms(f, values[f.name], self.edges[f.name]).items():
                self.counts[name] = self.counts.get(name, 0) + sign * np.asarray(counts, dtype="int64")
        if self.info.label_column and self.target is None:
            labels = values[self.info.label_column]
            self.labels += sign * np.bincount(labels, minlength=len(self.labels))[: len(self.labels)]
        self.rows += sign * len(next(iter(values.values())))

    def profile(self) -> Profile:
        features = {}
        for f in self.fields:
            for name, edges in self.edges[f.name].items():
                counts = self.counts.get(name, np.zeros(len(edges) - 1, dtype="int64"))
                features[name] = FeatureProfile(edges=[float(e) for e in edges], counts=[int(c) for c in counts])
        labels = {str(k): int(c) for k, c in enumerate(self.labels)}
        return Profile(rows=int(self.rows), features=features, labels=labels)


def _histograms(field: FieldSpec, v: np.ndarray, edges: dict[str, np.ndarray]) -> dict[str, list[int]]:
    if not edges or len(v) == 0:
        return {name: [0] * (len(e) - 1) for name, e in edges.items()}
    if field.dtype == "string":
        encoded = [s.encode("utf-8") for s in v]
        data = np.frombuffer(b"".join(encoded), dtype="uint8")
        return {
            f"{field.name}[length]": drift.histogram(np.array([len(s) for s in v]), LENGTH_EDGES),
            f"{field.name}[bytes]": np.bincount(data, minlength=256).tolist(),
        }
    if field.variable:
        return {f"{field.name}[length]": drift.histogram(np.array([len(a) for a in v]), LENGTH_EDGES)}
    if field.dtype == "uint8" and len(field.shape) == 3:
        # Ten bins of intensity by a table lookup: a uint8 channel, without a float copy of it.
        bins = (np.arange(256) * 10 // 256).astype("int64")
        out = {
            f"{field.name}[c{c}]": np.bincount(bins[v[:, c].reshape(-1)], minlength=10).tolist()
            for c in range(field.shape[0])
        }
        saturated = int(((v == 0) | (v == 255)).sum())
        out[f"{field.name}[saturated]"] = [v.size - saturated, saturated]
        return out
    name, e = next(iter(edges.items()))
    return {name: drift.histogram(v.reshape(-1).astype("float64"), e)}


def merge(profiles: list[Profile]) -> Profile:
    """The profile of several shards together (the same fields, so the same bins)."""
    out = Profile(rows=sum(p.rows for p in profiles))
    for p in profiles:
        for name, fp in p.features.items():
            if name in out.features:
                total = np.add(out.features[name].counts, fp.counts)
                out.features[name] = FeatureProfile(edges=fp.edges, counts=[int(c) for c in total])
            else:
                out.features[name] = FeatureProfile(edges=list(fp.edges), counts=list(fp.counts))
        for k, c in p.labels.items():
            out.labels[k] = out.labels.get(k, 0) + c
    return out


def psi(new: Profile, ref: Profile) -> dict[str, float]:
    """PSI of each histogram both profiles hold on the same bins, and of the labels."""
    out = {
        n: drift.psi(ref.features[n].counts, p.counts)
        for n, p in new.features.items()
        if n in ref.features and ref.features[n].edges == p.edges
    }
    if new.labels or ref.labels:
        classes = sorted(set(ref.labels) | set(new.labels), key=int)
        out["label"] = drift.psi([ref.labels.get(c, 0) for c in classes], [new.labels.get(c, 0) for c in classes])
    return out
