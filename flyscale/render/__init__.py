"""What people look at: figures, Flyte Decks, the validation report and the run summary.

May import every room below it (`tracking`, `train`, `evaluate`, `data`, ...) to read their
records; nothing below imports it.
"""
