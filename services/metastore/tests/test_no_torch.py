"""The metastore never touches a byte of KV: it starts without importing torch (1.7 s of imports
saved at every start of a stack), so a module that pulls torch in shows here."""

import subprocess
import sys


def test_the_metastore_server_imports_no_torch():
    code = "import sys, kvoffload_metastore.server; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout[:500]
