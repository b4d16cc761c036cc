"""The metastore package installs and imports with its own version."""
from importlib.metadata import version

import kvoffload_metastore


def test_version_matches_distribution():
    assert kvoffload_metastore.__version__ == version("kvoffload-metastore")
