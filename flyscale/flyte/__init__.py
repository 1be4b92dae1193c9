"""What flyscale needs from Flyte beyond tasks: cache versions derived from the facts a result
depends on (`caching`), answers memoised on disk (`memo`), flyscale's dataclasses as Flyte types
(`dataclass_types`), and which task bodies ran in this execution (`provenance`).

May import `plugin`, `errors` and `settings` only, so every room above can key its work by it.
"""
