"""Data, from a dataset plugin's rows to the batches training reads: loading and fingerprinting
(`source`), validation and quarantine (`validation`, `schemas`), the split, augmentation, drift
against the reference, Parquet shards, and streaming data larger than memory.

May import `config`, `plugin`, `errors` and `settings`; never training, tracking or Flyte.
"""
