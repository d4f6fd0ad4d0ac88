"""The installed mfpipe's version, which every store records as provenance (``code_version``)."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version


def _installed_version() -> str:
    try:
        return _version("mfpipe")
    except PackageNotFoundError:  # running from a source tree without install
        return "0.0.0+unknown"


__version__ = _installed_version()
