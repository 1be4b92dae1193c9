"""Acme's typed flyscale plugins: written against `flyscale.api`."""
