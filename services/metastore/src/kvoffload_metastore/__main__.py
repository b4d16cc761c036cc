"""``python -m kvoffload_metastore``: the same as the ``kvoffload-metastore`` command."""

from kvoffload_metastore.server import cli

cli()
