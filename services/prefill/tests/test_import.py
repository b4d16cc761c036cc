"""The prefill package installs and imports with its own version."""
from importlib.metadata import version

import kvoffload_prefill


def test_version_matches_distribution():
    assert kvoffload_prefill.__version__ == version("kvoffload-prefill")
