"""Loading a model imports no more of torch than it runs: building the layers uninitialized must not
go through the meta device, whose ``normal_`` imports torch._dynamo (seconds of CPU at the start of
every prefill, decode and TP rank)."""

import subprocess
import sys

from dsamodel.presets import write_tiny


def test_loading_a_model_does_not_import_dynamo(tmp_path):
    model = write_tiny(tmp_path / "tiny")
    code = (
        "import sys; from dsamodel.weights import load_model; "
        f"load_model({str(model)!r}); print('torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stdout[-500:] + out.stderr[-2000:]
