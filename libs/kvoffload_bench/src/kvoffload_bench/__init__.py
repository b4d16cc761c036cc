"""kvoffload_bench: the benchmarks ``kvoffload bench NAME --json`` runs, and the research code they
measure with (offline scoring, sizing curves, recorded traces). Nothing here runs in a service.

Each bench module exposes ``run(**params) -> dict``: keyword parameters with production-like
defaults, the thing measured and its baseline side by side in the same run, medians reported, and
the goals as booleans in ``goals_met``. Nothing is printed; absolute times on shared machines are
noise, so every headline number is a ratio or a rate measured next to its baseline.

The engine of the tiny model (bench ``prefill``, ``prefix``, ``decode``), both sides timed in one
process (``timing``: ``interleaved`` medians):

- ``prefill``: layerwise buffer reuse vs no reuse, on a deep tiny model.
- ``prefix``: the prefix cache: a second request on a shared prefix vs the first.
- ``decode``: sparse offload vs ``keep_device_kv_cache``, on prompts or on a top-k trace (I2).
  ``decode_trace``: its trace mode (a trace replayed over installed prompt KV, with miss prefetch);
  ``decode_report``: its goals and the JSON both modes return.

kvcore's native paths and the host pools (bench ``hotcache``, ``gather``, ``pool``):

- ``hotcache``: native vs vectorized torch (``hotcache_torch``) vs Python-reference
  ``HotCache.resolve`` on top-k traces; the policies against Belady's optimum (``belady``: the
  offline optimum hit rate); per-layer sizing.
- ``hotcache_torch``: ``TorchHotCache``, the hot cache in whole-tensor torch ops (the torch baseline).
- ``gather``: native ``gather_rows`` vs the torch reference vs a contiguous memcpy of the same bytes.
- ``pool``: each host-pool backend's put/get rates against memcpy (servers by the registry's launchers).
- ``hotsizing``: per-layer hot-buffer sizes from measured hit-rate curves, under one budget.
- ``miss_predictors``: offline scoring of miss predictors on a trace (the runtime prefetch is the engine's).
- ``otherload``: ``OtherLoad``, how much of the machine other processes used while a bench ran.

A real model's answers (bench ``quality``):

- ``quality``: sparse vs dense decode of SmolLM2 with its indexer: recall, perplexity, greedy
  agreement, planted facts; ``quality_text``: its documents and planted facts; ``quality_branch``:
  a context computed once and its dense and sparse continuations; ``quality_speed``: decode TPOT of
  the stack sparse and dense and of plain vLLM, side by side; ``quality_plot``: its curves as PNGs.

The P/D stack and vLLM (bench ``pd``, ``load``, ``vllm``):

- ``pd``: the P/D stack through the proxy vs the single-process engine (TTFT, TPOT, pull rate);
  ``pd_memcpy``: its memcpy references (the in-stack sampler, the idle diagnostic); ``pd_report``: its
  per-round figures, medians, TP 2 block and goals; ``pd_backends``: the pull on each P→D data path
  (shared memory, gRPC stream, Mooncake Transfer Engine) side by side, and across a network namespace;
  ``engine_ceiling``: Mooncake Transfer Engine's own rate here, out of any stack (the path's ceiling).
- ``load``: the P/D stack under a burst of concurrent clients vs the single-process engine;
  ``load_burst``: its burst case (mixed requests at once, no retry: answered, 429 or timed out);
  ``load_polite``: the same burst with clients that follow ``Retry-After`` as OpenAI's client does;
  ``load_report``: its result and goals.
- ``vllm_connectors``: the kvoffload connectors inside real vLLM servers (store hits, P/D). ``vllm_pools``:
  its store part on each pool backend (a store server per backend); ``vllm_pd``: its P/D part;
  ``vllm_backends``: the P/D pull on each transfer backend of the vLLM connectors, side by side;
  ``vllm_stream``: its timed streamed completions (TTFT, TPOT). ``vllm_goals``: its
  goals and what was not measured. ``vllm_shared``: its shared-layer-buffer figures (the P/D prefill's KV
  capacity, bytes per token, long-prompt TTFT and pool hits against the plain server). ``pd_matrix``: its
  P/D equality matrix (prompt lengths, completions and chat, streamed and not, a burst; plain vs proxy).

The stacks, servers, oracle and SSE reader these run on are ``kvoffload_testing``'s.

Traces:

- ``trace_record``: real top-k traces recorded from a pretrained model (``kvoffload trace record``).
- ``trace_indexer``: the live indexer's top-k trace of a Llama model with an indexer, along its sparse
  decode (``kvoffload trace record smollm2-indexer``).
- ``trace_prompts``: the prompts both recorders read (documents of this repository to summarize).
"""

__version__ = "0.1.0"
