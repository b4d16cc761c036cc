"""Support for integration tests that run real vLLM OpenAI servers: the real SmolLM2 model directory
(built once per machine), small random-weight Llama directories with its tokenizer, a context manager
that runs ``vllm.entrypoints.openai.api_server`` in its own process group, and plain-urllib request
helpers. Nothing here is mocked: every helper builds or talks to the real thing."""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path
from types import TracebackType
from typing import Any, Iterator, Mapping, Sequence

from kvoffload.stack import port_is_free

TINY_MARKER = "kvoffload-tiny-llama.json"
# The tokenizer and chat-template files a model directory may carry; those present are copied.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json")
EPHEMERAL_PORT_START = 32768  # Linux's default ip_local_port_range starts here


# ---- model directories ------------------------------------------------------------------------

def cache_root() -> Path:
    """``$KVOFFLOAD_CACHE``, or ``~/.cache/kvoffload``."""
    root = os.environ.get("KVOFFLOAD_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "kvoffload"


@contextlib.contextmanager
def dir_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``.<name>.lock`` next to ``path`` while building ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct directory, built by ``kvoffload model fetch smollm2`` into
    ``<cache root>/models/smollm2`` on first use (a complete directory is left as it is)."""
    from kvoffload.model_fetch import fetch, is_complete

    out = cache_root() / "models" / "smollm2"
    if is_complete(out):
        return out
    with dir_lock(out):
        fetch("smollm2", out, log=lambda line: print(f"kvoffload model fetch: {line}", flush=True))
    return out


def _tiny_record(seed: int, num_layers: int) -> dict:
    return {"seed": seed, "num_layers": num_layers, "tokenizer": "smollm2"}


def _tiny_is_complete(path: Path, record: dict) -> bool:
    """True when ``path`` holds a finished tiny model built with ``record``'s parameters; a finished one
    built with other parameters is an error, not something to overwrite."""
    try:
        found = json.loads((path / TINY_MARKER).read_text())
        files = dict(found["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if found.get("params") != record:
        raise ValueError(f"{path} already holds a tiny Llama built with {found.get('params')}, not {record}; "
                         f"use another directory")
    return all((path / name).is_file() and (path / name).stat().st_size == size
               for name, size in files.items())


def tiny_llama_dir(path: Path, *, seed: int = 0, num_layers: int = 2) -> Path:
    """Write a random-weight float32 Llama (hidden 128, 4 heads of 32, 2 KV heads) with the SmolLM2
    tokenizer into ``path`` unless it is already complete. The same ``seed`` gives byte-identical weights.
    The directory appears complete or not at all (built next to it, then renamed into place)."""
    path = Path(path).absolute()
    record = _tiny_record(seed, num_layers)
    if _tiny_is_complete(path, record):
        return path
    source = smollm2_dir()
    with dir_lock(path):
        if _tiny_is_complete(path, record):  # another process built it while we waited
            return path
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise FileExistsError(f"{path} exists and is not a complete tiny model; choose an empty or new "
                                  f"directory")
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.partial-") as tmp:
            build = Path(tmp) / "model"
            _write_tiny_llama(build, source, seed=seed, num_layers=num_layers)
            files = {p.name: p.stat().st_size for p in sorted(build.iterdir())}
            (build / TINY_MARKER).write_text(json.dumps({"params": record, "files": files}, indent=2) + "\n")
            os.replace(build, path)  # an empty directory at `path` is replaced too
    return path


def _write_tiny_llama(out: Path, tokenizer_dir: Path, *, seed: int, num_layers: int) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,  # vLLM CPU: head_dim >= 32
        intermediate_size=256, num_hidden_layers=num_layers, max_position_embeddings=4096,
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        dtype=torch.float32, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, out / name)


# ---- ports and processes ----------------------------------------------------------------------

def free_port(host: str = "127.0.0.1") -> int:
    """A random port that is free on ``host`` now, below the ephemeral range (32768+), where an outgoing
    connection's local end could take it before the server binds it."""
    rng = random.Random()
    for _ in range(500):
        port = rng.randrange(10000, EPHEMERAL_PORT_START)
        if port_is_free(port, host):
            return port
    raise RuntimeError(f"no free port found on {host} in 10000..{EPHEMERAL_PORT_START - 1} after 500 tries")


def group_members(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes in process group ``pgid``, from ``/proc``."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        # pid (comm) state ppid pgrp ...; comm may hold spaces and parentheses, so split after the last ')'
        state, _ppid, pgrp = stat[stat.rindex(")") + 2:].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            members.append(int(entry.name))
    return members


def tail(path: Path, lines: int = 60) -> str:
    """The last ``lines`` lines of the text file ``path`` (empty when it does not exist)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines))
    except FileNotFoundError:
        return ""


def _health_ok(url: str) -> bool:
    """True when ``GET url`` answers 200. Anything else, any exception included, means "not ready yet":
    here a connect can succeed with nobody listening (even to itself on an ephemeral port)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError):
        return False


class VllmServer:
    """A real vLLM OpenAI server (``python -m vllm.entrypoints.openai.api_server``) on 127.0.0.1, run in
    its own process group. ``with VllmServer(model) as s:`` waits for ``/health``; leaving the block
    stops the whole group (SIGTERM, then SIGKILL after ``stop_timeout_s``)."""

    def __init__(self, model: Path | str, *, port: int | None = None, max_model_len: int = 2048,
                 extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 kv_cache_space_gib: int | str = 1, log_path: Path | None = None,
                 start_timeout_s: float = 180.0, stop_timeout_s: float = 20.0) -> None:
        self.model = Path(model)
        self.port = port if port is not None else free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                    "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager", "--dtype", "float32",
                    "--max-model-len", str(max_model_len), *extra_args]
        # HF_HUB_OFFLINE: a model path that does not exist must fail, not be tried as a hub repo id
        self.env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_space_gib), "HF_HUB_OFFLINE": "1",
                    **(env or {})}
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="vllm-server-")) / "vllm.log"
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.proc: subprocess.Popen | None = None
        self.start_s: float | None = None  # seconds from launch to the first healthy answer
        self._stopped = False

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self) -> VllmServer:
        """Launch the server and wait until ``/health`` answers 200; on an early exit or a timeout stop
        it and raise :class:`RuntimeError` with the end of its log."""
        if self.proc is not None:
            raise RuntimeError(f"the vLLM server on {self.url} was already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, start_new_session=True)
        deadline = started + self.start_timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                self._fail(f"exited with status {code} before answering /health")
            if _health_ok(f"{self.url}/health"):
                self.start_s = time.monotonic() - started
                return self
            if time.monotonic() > deadline:
                self._fail(f"did not answer /health within {self.start_timeout_s:.0f} s")
            time.sleep(0.5)

    def _fail(self, why: str) -> None:
        self.stop()
        raise RuntimeError(f"vLLM server for {self.model} on {self.url} {why}; command: {' '.join(self.cmd)}\n"
                           f"last lines of {self.log_path}:\n{tail(self.log_path)}")

    def stop(self) -> None:
        """SIGTERM the server's process group, wait up to ``stop_timeout_s`` for every member to go, then
        SIGKILL what is left. Safe to call again."""
        if self.proc is None or self._stopped:
            return
        self._stopped = True
        pgid = self.proc.pid  # start_new_session: the server leads its own group
        if not self._signal_group(pgid, signal.SIGTERM, self.stop_timeout_s):
            self._signal_group(pgid, signal.SIGKILL, 10.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=1)
        if group_members(pgid):
            raise RuntimeError(f"processes {group_members(pgid)} of the vLLM server's group {pgid} survived SIGKILL")

    def _signal_group(self, pgid: int, sig: signal.Signals, timeout_s: float) -> bool:
        """Send ``sig`` to group ``pgid``; True once the leader is reaped and no member is alive."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.proc.poll()  # reaps the leader, so it does not linger as a zombie
            if self.proc.returncode is not None and not group_members(pgid):
                return True
            time.sleep(0.1)
        return False

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


# ---- requests ---------------------------------------------------------------------------------

def post_json(url: str, body: dict, timeout_s: float = 120.0) -> dict:
    """POST ``body`` as JSON and return the parsed answer; a non-2xx status raises :class:`RuntimeError`
    with the status and the body's text."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        raise RuntimeError(f"POST {url} answered {exc.code}: {text}") from None


def completion(url: str, prompt: str | list[int], max_tokens: int, *, timeout_s: float = 120.0,
               **kw: Any) -> dict:
    """``POST {url}/v1/completions`` (greedy unless ``temperature`` is given); other keywords go into the body."""
    return post_json(f"{url}/v1/completions",
                     {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}, timeout_s)


def chat(url: str, messages: list[dict], max_tokens: int, *, timeout_s: float = 120.0, **kw: Any) -> dict:
    """``POST {url}/v1/chat/completions`` (greedy unless ``temperature`` is given); other keywords go into
    the body."""
    return post_json(f"{url}/v1/chat/completions",
                     {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **kw}, timeout_s)
