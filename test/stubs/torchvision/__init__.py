"""Test-only stand-in for torchvision (see test/conftest.py): SGLang imports
`torchvision.io.decode_jpeg` when it loads, and no PyPI torchvision loads beside the
CPU torch build. Image functions raise; no test decodes images."""

from . import io, transforms  # noqa: F401

__version__ = "0.0.0+stub"
