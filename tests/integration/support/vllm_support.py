"""Support for integration tests that run real vLLM OpenAI servers (``kvoffload_testing.vllm_server``):
the real SmolLM2 model directory (built once per machine), small random-weight Llama and DeepSeek-V3
(MLA) directories with its tokenizer, and plain-urllib request helpers. Nothing here is mocked: every
helper builds or talks to the real thing."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

TINY_MARKER = "kvoffload-tiny-model.json"  # written last: its presence means the directory is complete
# The tokenizer and chat-template files a model directory may carry; those present are copied.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)


# ---- model directories ------------------------------------------------------------------------


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
    """The real SmolLM2-135M-Instruct directory (``kvoffload_testing.model_fetch.cached_model``: built once per
    machine)."""
    from kvoffload_testing.model_fetch import cached_model

    return cached_model("smollm2", log=lambda line: print(f"kvoffload model fetch: {line}", flush=True))


def _tiny_is_complete(path: Path, record: dict) -> bool:
    """True when ``path`` holds a finished tiny model built with ``record``'s parameters; a finished one
    built with other parameters is an error, not something to overwrite."""
    try:
        found = json.loads((path / TINY_MARKER).read_text())
        files = dict(found["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if found.get("params") != record:
        raise ValueError(
            f"{path} already holds a tiny model built with {found.get('params')}, not {record}; use another directory"
        )
    return all((path / name).is_file() and (path / name).stat().st_size == size for name, size in files.items())


def _tiny_model_dir(path: Path, record: dict, write: Callable[[Path, Path], None]) -> Path:
    """``path`` once it holds the tiny model ``record`` describes: unless already complete, ``write(out,
    tokenizer_dir)`` builds it next to ``path`` (under a lock), which is then renamed into place, so the
    directory appears complete or not at all."""
    path = Path(path).absolute()
    if _tiny_is_complete(path, record):
        return path
    source = smollm2_dir()
    with dir_lock(path):
        if _tiny_is_complete(path, record):  # another process built it while we waited
            return path
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise FileExistsError(f"{path} exists and is not a complete tiny model; choose an empty or new directory")
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.partial-") as tmp:
            build = Path(tmp) / "model"
            write(build, source)
            files = {p.name: p.stat().st_size for p in sorted(build.iterdir())}
            (build / TINY_MARKER).write_text(json.dumps({"params": record, "files": files}, indent=2) + "\n")
            os.replace(build, path)  # an empty directory at `path` is replaced too
    return path


def tiny_llama_dir(
    path: Path, *, seed: int = 0, num_layers: int = 2, sliding_window: int | None = None, max_positions: int = 4096
) -> Path:
    """Write a random-weight float32 Llama (hidden 128, 4 heads of 32, 2 KV heads) with the SmolLM2
    tokenizer into ``path`` unless it is already complete. The same ``seed`` gives byte-identical weights.
    The directory appears complete or not at all (built next to it, then renamed into place).
    ``sliding_window``: a hybrid model, odd layers sliding-window attention of that many tokens and even
    layers full attention (``layer_types``: vLLM's hybrid KV cache manager makes two KV cache groups).
    ``max_positions``: the longest sequence it takes (``max_position_embeddings``)."""
    record: dict[str, Any] = {"seed": seed, "num_layers": num_layers, "tokenizer": "smollm2"}
    if max_positions != 4096:
        record["max_positions"] = max_positions
    hybrid: dict[str, Any] = {}
    if sliding_window is not None:
        record["sliding_window"] = sliding_window
        hybrid = {
            "sliding_window": sliding_window,
            "layer_types": [("sliding_attention" if i % 2 else "full_attention") for i in range(num_layers)],
        }

    def write(out: Path, tokenizer_dir: Path) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            hidden_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,  # vLLM CPU: head_dim >= 32
            intermediate_size=256,
            num_hidden_layers=num_layers,
            max_position_embeddings=max_positions,
            **hybrid,
            **_tokenizer_ids(tokenizer_dir),
        )
        _save_seeded(LlamaForCausalLM, config, seed, out, tokenizer_dir)

    return _tiny_model_dir(path, record, write)


def tiny_deepseek_v3_dir(path: Path, *, seed: int = 0, num_layers: int = 2, max_positions: int = 4096) -> Path:
    """Write a random-weight float32 DeepSeek-V3-architecture model (``DeepseekV3ForCausalLM``: MLA
    attention, dense MLPs only: ``first_k_dense_replace`` = ``num_layers``, so no MoE layer) with the
    SmolLM2 tokenizer into ``path`` unless it is already complete; like :func:`tiny_llama_dir`
    otherwise. Hidden 128, 4 heads; the latent KV row is vLLM's CPU MLA decode kernel's only size:
    kv_lora_rank 512 + qk_rope_head_dim 64 = 576 values per token and layer. ``max_positions``: the longest
    sequence it takes."""
    record: dict[str, Any] = {
        "seed": seed,
        "num_layers": num_layers,
        "tokenizer": "smollm2",
        "architecture": "deepseek_v3",
    }
    if max_positions != 4096:
        record["max_positions"] = max_positions

    def write(out: Path, tokenizer_dir: Path) -> None:
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        config = DeepseekV3Config(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=num_layers,
            first_k_dense_replace=num_layers,  # every layer dense: no expert is built or loaded
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=64,
            kv_lora_rank=512,  # vLLM CPU_MLA: head size 576 = 512 + 64 only
            qk_rope_head_dim=64,
            qk_nope_head_dim=32,
            v_head_dim=32,
            num_nextn_predict_layers=0,
            max_position_embeddings=max_positions,
            **_tokenizer_ids(tokenizer_dir),
        )
        _save_seeded(DeepseekV3ForCausalLM, config, seed, out, tokenizer_dir)

    return _tiny_model_dir(path, record, write)


def _tokenizer_ids(tokenizer_dir: Path) -> dict[str, Any]:
    """The config fields a tiny model takes from the tokenizer it reuses."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "tie_word_embeddings": False,
    }


def _save_seeded(model_cls: Any, config: Any, seed: int, out: Path, tokenizer_dir: Path) -> None:
    """Build ``model_cls(config)`` with weights drawn after ``torch.manual_seed(seed)``, save it in float32
    safetensors into ``out`` with the tokenizer files of ``tokenizer_dir``."""
    import torch

    config.dtype = torch.float32
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, out / name)


# ---- requests ---------------------------------------------------------------------------------


def post_json(url: str, body: dict, timeout_s: float = 120.0) -> dict:
    """POST ``body`` as JSON and return the parsed answer; a non-2xx status raises :class:`RuntimeError`
    with the status and the body's text."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        raise RuntimeError(f"POST {url} answered {exc.code}: {text}") from None


def completion(url: str, prompt: str | list[int], max_tokens: int, *, timeout_s: float = 120.0, **kw: Any) -> dict:
    """``POST {url}/v1/completions`` (greedy unless ``temperature`` is given); other keywords go into the body."""
    return post_json(
        f"{url}/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}, timeout_s
    )


def chat(url: str, messages: list[dict], max_tokens: int, *, timeout_s: float = 120.0, **kw: Any) -> dict:
    """``POST {url}/v1/chat/completions`` (greedy unless ``temperature`` is given); other keywords go into
    the body."""
    return post_json(
        f"{url}/v1/chat/completions",
        {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **kw},
        timeout_s,
    )


def stream_choices(url: str, path: str, body: dict, timeout_s: float = 180.0) -> list[dict]:
    """``POST {url}{path}`` with ``body`` streamed (SSE): the first choice of every event, in order (a
    completion's has ``text`` and, when asked, ``logprobs``; a chat's ``delta`` and ``logprobs``). A
    stream that ends without ``data: [DONE]`` raises ``kvoffload_testing.sse.StreamTruncated``."""
    from kvoffload_testing.sse import sse_events

    request = urllib.request.Request(
        f"{url}{path}",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        return [event["choices"][0] for event in sse_events(resp, require_done=True) if event.get("choices")]


# ---- kv-transfer-configs ---------------------------------------------------------------------


def store_config(metastore: str | None, role: str = "kv_both", **extra: Any) -> str:
    """An ``AscendStoreConnector`` config on the kvoffload backend (a 0.25 GB pool), ``extra`` keys added."""
    body = {"backend": "kvoffload", "use_layerwise": True, "host_pool_gb": 0.25, **extra}
    if metastore:
        body["metastore"] = metastore
    return json.dumps(
        {
            "kv_connector": "AscendStoreConnector",
            "kv_role": role,
            "kv_connector_module_path": "kvoffload_vllm",
            "kv_connector_extra_config": body,
        }
    )


# ---- launches that must fail --------------------------------------------------------------------


def failed_starts(servers: dict[str, Any], at_once: int = 2) -> dict[str, str]:
    """Start every ``VllmServer`` of ``servers`` (each expected to refuse its config) side by side, at
    most ``at_once`` at a time, and return the ``RuntimeError`` message of each, by the same keys: a
    vLLM start-up is paid in parallel instead of once per case. A server that starts after all is
    stopped, and its message says so (the test reading it then fails)."""
    from concurrent.futures import ThreadPoolExecutor

    def outcome(server: Any) -> str:
        try:
            server.start()
        except RuntimeError as exc:
            return str(exc)
        finally:
            server.stop()  # one that did start is not left behind
        return f"STARTED: the server on {server.url} accepted its config"

    with ThreadPoolExecutor(at_once) as pool:
        return dict(zip(servers, pool.map(outcome, servers.values()), strict=True))


def refusals(
    model: Path, cases: dict[str, list[str]], log_dir: Path, max_model_len: int = 1024, timeout_s: float = 600.0
) -> dict[str, tuple[str, str]]:
    """Each case's extra server arguments (``VllmServer``'s ``extra_args``), on ``model``, taken as far
    as vLLM's engine in one process that imports vLLM once (``vllm_refusals.py``): ``(error, log)`` by
    case, where ``error`` is the exception that stopped it with its causes, or ``STARTED: ...`` when its
    engine was built after all (the test reading it then fails)."""
    import subprocess
    import sys

    from kvoffload_testing.vllm_server import api_server_command, api_server_env, free_port

    argv = {
        name: api_server_command(model, port=free_port(), max_model_len=max_model_len, extra_args=extra)
        for name, extra in cases.items()
    }
    argv = {name: a[a.index("--model") :] for name, a in argv.items()}  # the server's own arguments
    log_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("vllm_refusals.py"))],
        input=json.dumps(argv),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, **api_server_env(), "VLLM_REFUSALS_LOG_DIR": str(log_dir)},
    )
    found = {
        r["case"]: r
        for r in (json.loads(line[len("RESULT ") :]) for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    }
    if proc.returncode != 0 or found.keys() != cases.keys():
        raise RuntimeError(
            f"vllm_refusals.py exited with {proc.returncode} and answered {sorted(found)} of "
            f"{sorted(cases)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return {
        name: (
            f"STARTED: {name} built its engine" if r["started"] else r["error"],
            Path(r["log"]).read_text(errors="replace"),
        )
        for name, r in found.items()
    }
