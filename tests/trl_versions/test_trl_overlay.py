"""The layout the older series run in (scripts/setup_trl_versions.sh): the release of a series sits in a folder put
first on PYTHONPATH over the main .venv, which keeps its own TRL 1.16. Whatever asks which TRL is there must get the
overlay's answer: the imported module, importlib.metadata (which TRL's and transformers' version gates read) and
transformers' availability check; a TRL copied in without its metadata, or a folder later on the path, would give
1.16's metadata to 1.12's code."""
import importlib.metadata
import pathlib

from ..support.trl_versions_env import require_series

SERIES = require_series("1.12", "1.13", "1.14", "1.15")

import trl  # noqa: E402
from transformers.utils import import_utils  # noqa: E402


def test_the_imported_trl_and_its_metadata_are_the_overlays():
    folder = pathlib.Path(trl.__file__).resolve().parents[1]  # .../.trl-versions/SERIES/trl/__init__.py
    distribution = importlib.metadata.distribution("trl")
    assert pathlib.Path(distribution.locate_file("")).resolve() == folder, (distribution.locate_file(""), folder)
    assert importlib.metadata.version("trl") == trl.__version__ == distribution.version
    assert ".".join(trl.__version__.split(".")[:2]) == SERIES
    assert import_utils._is_package_available("trl", return_version=True) == (True, trl.__version__)
