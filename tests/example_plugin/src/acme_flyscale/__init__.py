"""Acme's flyscale plugins. Nothing here imports flyscale: the entry points in pyproject.toml
are the whole contract, and flyscale checks each plugin by its attributes."""
