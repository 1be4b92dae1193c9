"""The plugin system: one registry per kind, filled from Python entry points (`registry`),
and the contract each kind satisfies: its Protocol (`data_protocols`, `strategy_protocol`,
`model_protocols`, `objective_protocol`), the records plugins exchange (`records`), and what the
registry holds each kind to (`kinds`); `contracts` hands all of them on under its older name.

The bottom room with `errors` and `settings`: it imports nothing else of flyscale, and never a
plugin package; plugins are found by their entry points.
"""
