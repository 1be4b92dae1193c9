"""A plugin module that cannot be imported, as happens when a dependency is missing.

flyscale must report it (with this package's name and the error) and keep every other plugin
usable; this module exists only to prove that.
"""

raise ImportError("acme_flyscale.broken needs the 'acme-cuda-kernels' package, which is not installed")
