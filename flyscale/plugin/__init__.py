"""The plugin system: one registry per kind, filled from Python entry points (`registry`),
and the contract each kind satisfies (`contracts`).

The bottom room with `errors` and `settings`: it imports nothing else of flyscale, and never a
plugin package; plugins are found by their entry points.
"""
