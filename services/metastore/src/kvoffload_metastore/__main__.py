"""``python -m kvoffload_metastore``: the same as the ``kvoffload-metastore`` command."""

import sys

from kvoffload_metastore.server import main

sys.exit(main())
