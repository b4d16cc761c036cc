"""The proxy package installs and imports with its own version."""
from importlib.metadata import version

import kvoffload_proxy


def test_version_matches_distribution():
    assert kvoffload_proxy.__version__ == version("kvoffload-proxy")
