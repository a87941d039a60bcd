"""btnode: BlockTrain, decentralised block-local pre-training of a byte-level language model."""

from importlib import metadata

try:
    __version__ = metadata.version("btnode")  # the installed build's, from pyproject.toml
except metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0.2.0"
