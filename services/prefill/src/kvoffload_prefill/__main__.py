import sys

from kvoffload_prefill.server import main

sys.exit(main())
