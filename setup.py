"""The one C extension: block names on the request path (shared/block_hashes.py).

Everything else about the package is in pyproject.toml. The extension is optional: an
install without a C compiler still works, on the pure-Python names, and the gateway says
so at start-up.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("shared._chain", ["shared/_chain.c"], optional=True)])
