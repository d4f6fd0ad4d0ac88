"""mfpipe: attention mean-field analysis of language models."""

from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("mfpipe")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+unknown"
