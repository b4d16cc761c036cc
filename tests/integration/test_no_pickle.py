"""No pickle or eval of network data anywhere: every package's source is scanned (by its syntax
tree, so comments and docstrings do not count) for the ways Python turns bytes into code or
arbitrary objects. A finding fails naming file:line and what was used.

Forbidden: importing pickle / cPickle / _pickle / dill / cloudpickle / jsonpickle / shelve / marshal;
calling eval() / exec(); torch.load without weights_only=True; yaml.load without a safe Loader
(and yaml.unsafe_load / yaml.full_load / yaml.load_all without one); numpy.load with
allow_pickle=True; multiprocessing.connection Listener/Client (pickles over sockets).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = [
    *sorted(ROOT.glob("libs/*/src")),
    *sorted(ROOT.glob("services/*/src")),
    ROOT / "kvoffload",
    ROOT / "proto",
]
PICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "jsonpickle", "shelve", "marshal"}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"}


def _dotted(node: ast.AST) -> str:
    """``torch.load`` for Attribute(Name('torch'), 'load'); "" for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def findings(source: str, filename: str) -> list[str]:
    """``file:line: what`` for every forbidden use in one Python source."""
    out: list[str] = []
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            out += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in PICKLERS]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.split(".")[0] in PICKLERS:
                out.append(f"{where}: from {module} import ...")
            if module == "multiprocessing.connection" and {a.name for a in node.names} & {"Listener", "Client"}:
                out.append(f"{where}: multiprocessing.connection Listener/Client (pickles over sockets)")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            last = name.rsplit(".", 1)[-1]
            if name in ("eval", "exec", "builtins.eval", "builtins.exec"):
                out.append(f"{where}: {name}()")
            elif name == "torch.load" or name.endswith(".torch.load"):
                if not _is_true(_keyword(node, "weights_only")):
                    out.append(f"{where}: {name}() without weights_only=True")
            elif name.startswith("yaml.") and last in ("unsafe_load", "full_load", "unsafe_load_all", "full_load_all"):
                out.append(f"{where}: {name}()")
            elif name.startswith("yaml.") and last in ("load", "load_all"):
                loader = _keyword(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
                if loader is None or _dotted(loader).rsplit(".", 1)[-1] not in SAFE_YAML_LOADERS:
                    out.append(f"{where}: {name}() without Loader=yaml.SafeLoader")
            elif name.split(".")[0] in ("np", "numpy") and last == "load" and _is_true(_keyword(node, "allow_pickle")):
                out.append(f"{where}: {name}(allow_pickle=True)")
            elif name.startswith("multiprocessing.connection.") and last in ("Listener", "Client"):
                out.append(f"{where}: {name}() (pickles over sockets)")
        elif (
            isinstance(node, ast.Attribute)
            and _dotted(node).split(".")[0] in PICKLERS
            and isinstance(node.ctx, ast.Load)
            and _dotted(node).count(".") == 1
        ):
            out.append(f"{where}: {_dotted(node)}")
    return sorted(set(out))


def _sources() -> list[Path]:
    files = []
    for d in SOURCE_DIRS:
        files += [p for p in d.rglob("*.py") if not any(part in (".venv", "build", "__pycache__") for part in p.parts)]
    return sorted(files)


def test_the_scan_covers_every_package():
    files = _sources()
    rel = {str(p.relative_to(ROOT)) for p in files}
    for prefix in (
        "libs/kvcore/src/",
        "libs/dsamodel/src/",
        "services/metastore/src/",
        "services/prefill/src/",
        "services/decode/src/",
        "services/proxy/src/",
        "kvoffload/",
        "proto/",
    ):
        assert any(r.startswith(prefix) for r in rel), f"no Python source scanned under {prefix}"
    assert len(files) > 50


def test_no_pickle_eval_or_unsafe_loader_in_any_package():
    found = []
    for path in _sources():
        found += findings(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert not found, "unsafe deserialization or code evaluation:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "snippet, expected",
    [
        ("import pickle\n", "x.py:1: import pickle"),
        ("import os\nfrom pickle import loads\n", "x.py:2: from pickle import ..."),
        ("import marshal as m\n", "x.py:1: import marshal"),
        ("import dill\n", "x.py:1: import dill"),
        ("eval(data)\n", "x.py:1: eval()"),
        ("exec(code, {})\n", "x.py:1: exec()"),
        ("import torch\nt = torch.load(f)\n", "x.py:2: torch.load() without weights_only=True"),
        ("import torch\nt = torch.load(f, weights_only=False)\n", "x.py:2: torch.load() without weights_only=True"),
        ("import yaml\nyaml.load(s)\n", "x.py:2: yaml.load() without Loader=yaml.SafeLoader"),
        ("import yaml\nyaml.load(s, Loader=yaml.Loader)\n", "x.py:2: yaml.load() without Loader=yaml.SafeLoader"),
        ("import yaml\nyaml.unsafe_load(s)\n", "x.py:2: yaml.unsafe_load()"),
        ("import numpy as np\nnp.load(f, allow_pickle=True)\n", "x.py:2: np.load(allow_pickle=True)"),
        (
            "from multiprocessing.connection import Listener\n",
            "x.py:1: multiprocessing.connection Listener/Client (pickles over sockets)",
        ),
    ],
)
def test_the_scanner_finds_each_forbidden_use(snippet, expected):
    assert expected in findings(snippet, "x.py")


@pytest.mark.parametrize(
    "snippet",
    [
        '"""we never pickle: eval( and exec( in a docstring are fine"""\n',
        "# import pickle\n",
        "import torch\nt = torch.load(f, weights_only=True)\n",
        "import yaml\nyaml.load(s, Loader=yaml.SafeLoader)\nyaml.safe_load(s)\n",
        "import numpy as np\nnp.load(f)\n",
        "import json\njson.loads(s)\n",
        "x.evaluate()\nmodel.eval()\n",
    ],
)
def test_the_scanner_accepts_safe_code(snippet):
    assert findings(snippet, "x.py") == []
