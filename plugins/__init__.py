"""flyscale's built-in plugins. Installed as the import package `flyscale_plugins` (a
package-dir mapping in pyproject.toml), so no generic top-level name reaches site-packages.

They depend on flyscale exactly as a third-party plugin package may, and register through the
same entry-point groups; flyscale's core never imports them.
"""
