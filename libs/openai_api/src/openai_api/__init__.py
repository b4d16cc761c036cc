"""openai_api: kvoffload's OpenAI request/response layer, torch-free; the decode, the prefill (both
modes) and the proxy import it, the model library's sampler takes its ``SamplingParams``.

One concept per module:

- ``fields``          the parameters refused by name (``UNSUPPORTED``), the P/D wiring keys
                      (``WIRING``), the limits (``MAX_N``, ``MAX_STOP``, ``MAX_SEED``, ``MAX_LOGPROBS``).
- ``body_types``      ``CompletionRequest``, ``ChatCompletionRequest``: the typed bodies (every accepted
                      field, its type, limits and rule; the combinations refused; -> ``SamplingParams``);
                      the proxy's ``/openapi.json`` is generated from them.
- ``body``            ``read_body`` (bytes -> the JSON object), ``validate_body`` (the one validation of
                      a body: -> its typed request), ``validated``, ``RequestError`` (names the field).
- ``request``         ``parse_request``: a single-prompt body -> ``ParsedRequest`` (prompt ids,
                      ``SamplingParams``, ``kv_transfer_params``); ``prompt_ids``.
- ``dispatch``        ``parse_dispatch``: the proxy's prefill dispatch -> its children.
- ``transfer_params`` ``KVTransferParams``: the typed ``kv_transfer_params`` of the P/D wiring.
- ``sampling_params`` ``SamplingParams`` (one request's sampling settings), ``choice_seed``.
- ``stop_text``       ``StopText``: generated tokens -> client text, cut before the first stop string.
- ``logprobs``        ``TokenLogprob`` and the OpenAI ``logprobs`` objects; ``finish_reason``.
- ``output``          sampled tokens -> completion / chat answers (JSON or SSE objects).
- ``tokenizer``       ``Tokenizer``: the tokenizer interface the layer needs.
"""

__version__ = "0.1.0"
