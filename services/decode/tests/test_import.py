"""The decode package installs and imports with its own version."""
from importlib.metadata import version

import kvoffload_decode


def test_version_matches_distribution():
    assert kvoffload_decode.__version__ == version("kvoffload-decode")
