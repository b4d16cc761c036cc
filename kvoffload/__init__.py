"""kvoffload: the ``kvoffload`` command (one CLI with subcommands) over the monorepo's packages."""

__version__ = "0.1.0"
