"""The speed half of ``kvoffload bench quality``: decode TPOT at batch 1, sparse against dense against vLLM.

Three systems serve SmolLM2-135M-Instruct in bfloat16 (``served_model("smollm2")``, its PCA indexer
built on first use), all up at once:

- ``sparse``: the reference P/D stack (metastore, prefill, decode, proxy) with sparse-offload decode
  at the model's own index_topk (512) over a hot buffer of twice that;
- ``dense``: a second stack of the same engine whose decode keeps the whole KV cache on the device
  (``keep_device_kv_cache: true``, sparse offload off) and whose model directory is the same files
  with the indexer's index_topk raised to max_model_len, so each step's selection keeps every past
  token: attention over the full context from device memory, no host pool, no hot buffer. The decode
  service has no other dense mode (it always attends a top-k), so this is the dense run; its top-k
  path gathers and attends index_topk slots whatever the context (the unused ones masked), so below
  max_model_len it does more work than a dense engine would;
- ``vllm``: a plain vLLM OpenAI server of the same model directory (``VllmServer``, ``--dtype bfloat16``).

Every decode runs the same number of OpenMP threads (the stack's decode share of this host's cores).
The prompts are token ids of real text (``dsamodel.indexer_corpus.HELD_OUT``, tokenized by the model's
own tokenizer), one disjoint slice per context length and round, the same slice sent to all three, so
no prefix cache helps one system only. Each round sends every context to every system one request at
a time, the systems' order rotating per round, so machine noise hits all three alike. TPOT is the
client's own stream timing for all three (``vllm_stream.tpot``: first to last streamed token over the
tokens in between; greedy, ``ignore_eos``, ``max_tokens=new_tokens``); a stream that carried all its
tokens in one event has no timing and its figure is named in ``not_measured``, never estimated.

Device KV per request comes from each stack decode's Stats (``device_kv_bytes``, ``device_indexer_bytes``,
``device_hot_bytes``) over its ``max_num_seqs`` (1 here: the one request's reservation). Every system runs
max_model_len = the model's max_position_embeddings (8192, what ``kvoffload up --model smollm2`` serves).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvoffload_bench.vllm_stream import tpot
from kvoffload_testing.sse import sse_events

SYSTEMS = ("sparse", "dense", "vllm")
DENSE_HOW = (
    "decode with keep_device_kv_cache (full KV on the device, sparse offload off) and index_topk raised "
    "to max_model_len, so every step attends every past token; its top-k path still scores and gathers "
    "max_model_len slots (the unused ones masked), so a context shorter than that pays for the whole"
)
WARMUP_TOKENS = 256
NO_TIMING = "the stream carried all its tokens in one event: no timing"


def _stderr(line: str) -> None:
    import sys

    print(f"kvoffload bench quality: {line}", file=sys.stderr, flush=True)


def label(ctx: int) -> str:
    """A context length's key: 2048 -> "2k", 7168 -> "7k" (under 1024 tokens, the number: "256")."""
    return f"{round(ctx / 1024)}k" if ctx >= 1024 else str(ctx)


def prompts(model_dir: Path, contexts: Sequence[int], rounds: int) -> dict[tuple[int, int], list[int]]:
    """(context, round) -> that many token ids of held-out text, every slice disjoint from the others
    (round -1: the warm-up, ``WARMUP_TOKENS`` long)."""
    from dsamodel.hf_tokenizer import HFTokenizer
    from dsamodel.indexer_corpus import HELD_OUT

    tok = HFTokenizer.from_dir(model_dir)
    ids = [t for source in HELD_OUT for t in tok.encode(source.text())]
    wanted = [(WARMUP_TOKENS, -1)] + [(ctx, r) for r in range(rounds) for ctx in contexts]
    if sum(n for n, _ in wanted) > len(ids):
        raise ValueError(f"the held-out text has {len(ids)} tokens: too few for {rounds} rounds of {list(contexts)}")
    out, at = {}, 0
    for n, r in wanted:
        out[(n, r)] = ids[at : at + n]
        at += n
    return out


def linked_model(model_dir: Path, out: Path, index_topk: int | None) -> Path:
    """``model_dir``'s files linked into ``out``: with the indexer's index_topk set to ``index_topk``, or
    (None) without the indexer (plain vLLM serves the model as it is)."""
    from dsamodel.pca_indexer import INDEXER_META, INDEXER_WEIGHTS

    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file():  # the weights, config and tokenizer; the indexer has a folder of its own
            (out / f.name).symlink_to(f.absolute())
    if index_topk is not None:
        (out / INDEXER_WEIGHTS).parent.mkdir()
        (out / INDEXER_WEIGHTS).symlink_to((model_dir / INDEXER_WEIGHTS).absolute())
        meta = json.loads((model_dir / INDEXER_META).read_text())
        (out / INDEXER_META).write_text(json.dumps({**meta, "index_topk": index_topk}))
    return out


def stack_config(model: Path, log_dir: Path, max_len: int, threads: int, dense: bool, taken: set[int]):
    """A one-prefill, one-decode reference stack of ``model`` on ports not in ``taken`` (which get its)."""
    from dsamodel.served import read_config
    from kvoffload_engine.model_layout import kv_layout
    from kvoffload_testing.ports import DATA_PORT_OFFSET, free_stack_ports
    from kvoffload_testing.stack import StackConfig

    layout = kv_layout(read_config(model), 16)
    row = sum(layer.row_bytes for layer in layout.layers)
    topk = read_config(model).index_topk or 64
    hot = max_len if dense else 2 * topk
    sparse = {"enabled": not dense, "keep_device_kv_cache": dense, "topk_buffer_size": hot, "dram_size_per_dp_GB": 1}
    while True:
        ports = free_stack_ports()
        used = {v for p in ports.values() for v in (p if isinstance(p, tuple) else (p,))}
        used |= {p + DATA_PORT_OFFSET for p in ports["prefill_ports"]}
        if not used & taken:
            taken |= used
            break
    bf16 = ["--dtype", "bfloat16"]
    decode = [*bf16, "--max-num-seqs", "1", "--additional-config", json.dumps({"sparse_kv_offload_config": sparse})]
    return StackConfig(
        model=model,
        log_dir=log_dir,
        max_model_len=max_len,
        topk_buffer_size=hot,
        prefill_pool_gb=max(0.25, round(2 * max_len * row / 2**30, 2)),
        service_env={"decode-0": {"OMP_NUM_THREADS": str(threads)}},
        service_args={"decode-0": decode, "prefill-0": bf16},
        **ports,
    )


def decode_threads() -> int:
    """The OpenMP threads of a loopback stack's decode on this host (``colocated_threads_env``)."""
    from kvoffload_testing.stack_threads import colocated_threads_env

    env = colocated_threads_env("decode-0", len(os.sched_getaffinity(0)), {})
    return int(os.environ.get("OMP_NUM_THREADS") or env["OMP_NUM_THREADS"])


def model_id(url: str, timeout_s: float = 120.0) -> str:
    """The first model ``url``'s ``/v1/models`` lists, asked again while it answers an error (a proxy
    answers 503 until its decoder answers it in time, which a loaded machine can delay)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as resp:
                return json.loads(resp.read())["data"][0]["id"]
        except urllib.error.URLError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def stream_stamps(url: str, model: str, prompt: list[int], new_tokens: int) -> list[float]:
    """Each streamed token's arrival (seconds after the send) of a greedy ``ignore_eos`` completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True}
    body |= {"ignore_eos": True, "logprobs": 0}
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0, stamps = time.perf_counter(), []
    with urllib.request.urlopen(req, timeout=900) as resp:
        for event in sse_events(resp):
            if "error" in event:
                raise RuntimeError(f"the completion on {url} failed: {event['error']}")
            for choice in event["choices"]:
                got = (choice.get("logprobs") or {}).get("tokens") or []
                stamps += [time.perf_counter() - t0] * len(got)
    if len(stamps) != new_tokens:
        raise RuntimeError(f"{url} streamed {len(stamps)} tokens, not the {new_tokens} asked for (ignore_eos)")
    return stamps


def start_all(es: contextlib.ExitStack, model_dir: Path, work: Path, max_len: int, threads: int, log) -> dict:
    """The three systems started side by side (each stopped when ``es`` closes): name -> (url, model id,
    the stack's config or None)."""
    from kvoffload_testing.stack import Stack
    from kvoffload_testing.vllm_server import VllmServer, free_port

    taken: set[int] = set()
    cfgs = {
        "sparse": stack_config(model_dir, work / "sparse", max_len, threads, False, taken),
        "dense": stack_config(
            linked_model(model_dir, work / "dense-model", max_len), work / "dense", max_len, threads, True, taken
        ),
    }
    port = next(p for p in iter(free_port, None) if p not in taken)
    env = {"OMP_NUM_THREADS": str(threads)}
    vllm = VllmServer(
        linked_model(model_dir, work / "vllm-model", None),
        port=port,
        max_model_len=max_len,
        extra_args=["--dtype", "bfloat16"],
        env=env,
        log_path=work / "vllm.log",
        start_timeout_s=900,
    )
    stacks = {name: Stack(cfg) for name, cfg in cfgs.items()}
    for stack in stacks.values():
        es.callback(stack.stop)
    es.callback(vllm.stop)
    # vLLM starts on a thread of its own; the stacks on this one: their services get SIGTERM when the
    # thread that spawned them ends (kvoffload_testing.service: die_with_parent)
    with ThreadPoolExecutor(1) as pool:
        vllm_up = pool.submit(vllm.start)
        for stack in stacks.values():
            stack.start(900, progress=False)
        vllm_up.result()
    log(f"up: sparse {stacks['sparse'].url}, dense {stacks['dense'].url}, vllm {vllm.url} (logs in {work})")
    out: dict[str, tuple[str, str, Any]] = {n: (s.url, model_id(s.url), cfgs[n]) for n, s in stacks.items()}
    out["vllm"] = (vllm.url, model_id(vllm.url), None)
    return out


def run_rounds(systems: dict, texts: dict, contexts: Sequence[int], rounds: int, new_tokens: int, log) -> dict:
    """(context, system) -> each round's TPOT, or why it has none (a str: the stream carried no timing,
    or the request failed; the other systems go on), the rounds interleaved."""
    for url, model, _ in systems.values():  # warm-up, untimed
        stream_stamps(url, model, texts[(WARMUP_TOKENS, -1)], new_tokens)
    out: dict[tuple[int, str], list[float | str]] = {(c, n): [] for c in contexts for n in SYSTEMS}
    for r in range(rounds):
        order = SYSTEMS[r % 3 :] + SYSTEMS[: r % 3]
        for ctx in contexts:
            for name in order:
                url, model, _ = systems[name]
                try:
                    stamps = stream_stamps(url, model, texts[(ctx, r)], new_tokens)
                except (OSError, RuntimeError) as exc:  # URLError among them: a server that died
                    out[(ctx, name)].append(f"round {r}: {type(exc).__name__}: {exc}"[:300])
                    continue
                t = tpot(stamps) if stamps[-1] > stamps[0] else None
                out[(ctx, name)].append(f"round {r}: {NO_TIMING}" if t is None else t)
            log(f"round {r} {label(ctx)}: " + ", ".join(f"{n} {out[(ctx, n)][-1]}" for n in order))
    return out


def device_kv(systems: dict) -> dict[str, dict[str, float]]:
    """Per request (each decode's Stats over its max_num_seqs): device KV bytes, its indexer and hot
    buffer parts, and the full KV the dense decode keeps (the rest)."""
    from kvoffload_testing.stack_client import stack_stats

    out = {}
    for name in ("sparse", "dense"):
        d = stack_stats(systems[name][2])["decode-0"]
        per = {k: d[f"device_{k}_bytes"] / d["max_num_seqs"] for k in ("kv", "indexer", "hot")}
        out[name] = {**per, "full_kv": per["kv"] - per["indexer"] - per["hot"]}
    return out


def summarize(samples: dict, kv: dict, contexts: Sequence[int], new_tokens: int, rounds: int, threads: int) -> dict:
    """The result dict (module docstring) from the rounds' TPOTs and the decodes' device KV."""
    tpots: dict[str, dict[str, float]] = {}
    not_measured: dict[str, str] = {}
    for ctx in contexts:
        key, tpots[label(ctx)] = label(ctx), {}
        for name in SYSTEMS:
            got = samples[(ctx, name)]
            why = [t for t in got if isinstance(t, str)]
            if why:
                not_measured[f"tpot_s.{key}.{name}"] = why[0]
            else:
                tpots[key][name] = statistics.median(got)
    to_vllm = {k: v["sparse"] / v["vllm"] for k, v in tpots.items() if "sparse" in v and "vllm" in v}
    to_dense = {k: v["sparse"] / v["dense"] for k, v in tpots.items() if "sparse" in v and "dense" in v}
    for k, v in tpots.items():
        for ratio, other in (("tpot_ratio_to_vllm", "vllm"), ("tpot_ratio_sparse_to_dense", "dense")):
            if not {"sparse", other} <= v.keys():
                not_measured[f"{ratio}.{k}"] = "a TPOT it divides was not measured"
    s, d = kv["sparse"], kv["dense"]
    return {
        "contexts": list(contexts),
        "new_tokens": new_tokens,
        "rounds": rounds,
        "tpot_s": tpots,
        "tpot_ratio_to_vllm": to_vllm,
        "tpot_ratio_sparse_to_dense": to_dense,
        "device_kv_bytes": {"sparse": int(s["kv"]), "dense": int(d["kv"])},
        "device_kv_bytes_parts": {n: {k: int(v) for k, v in kv[n].items() if k != "kv"} for n in kv},
        "device_kv_ratio": s["kv"] / d["kv"],
        "device_kv_ratio_bound": (s["hot"] + s["indexer"]) / d["full_kv"],
        "threads": threads,
        "dense_mode": DENSE_HOW,
        "prefix_cache": "on everywhere; every request's prompt is a slice no other request shares",
        "tpot_source": "client stream: (last token - first token) / (tokens - 1)",
        "not_measured": not_measured,
    }


def measure_speed(
    contexts: Sequence[int] = (2048, 4096, 7168),
    *,
    new_tokens: int = 32,
    rounds: int = 2,
    log: Callable[[str], None] = _stderr,
) -> dict:
    """Decode TPOT at batch 1 of the sparse stack, the dense stack and plain vLLM, side by side, and the
    two stacks' device KV per request (module docstring)."""
    from dsamodel.served import read_config
    from kvoffload_testing.model_indexer import served_model

    if new_tokens < 2:
        raise ValueError(f"new_tokens: got {new_tokens}; a TPOT needs two tokens or more")
    if len({label(c) for c in contexts}) != len(contexts):
        raise ValueError(f"contexts: {list(contexts)} give the same key twice ({[label(c) for c in contexts]})")
    model_dir = served_model("smollm2", log=log)
    max_len = read_config(model_dir).max_position_embeddings  # what `kvoffload up --model smollm2` serves
    if max(contexts) + new_tokens > max_len:
        raise ValueError(f"contexts: {max(contexts)} + {new_tokens} new tokens exceed the model's {max_len}")
    texts = prompts(model_dir, contexts, rounds)
    threads = decode_threads()
    work = Path(tempfile.mkdtemp(prefix="kvoffload-bench-quality-"))
    with contextlib.ExitStack() as es:
        systems = start_all(es, model_dir, work, max_len, threads, log)
        samples = run_rounds(systems, texts, contexts, rounds, new_tokens, log)
        kv = device_kv(systems)
    return {**summarize(samples, kv, contexts, new_tokens, rounds, threads), "max_model_len": max_len}
