import sys

from kvoffload_decode.server import main

sys.exit(main())
