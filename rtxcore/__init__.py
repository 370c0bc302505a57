"""rtx-serve core: plugin contracts, engine, KV cache, servers and CLI."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("rtx-serve")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+source"
