"""The names and limits a request body is checked against: the known OpenAI / vLLM parameters this
engine refuses by name (``UNSUPPORTED``), the P/D wiring a body may carry beside its fields
(``WIRING``) and the request limits. The accepted fields themselves are the typed models of
``body_types``."""

from __future__ import annotations

# Known OpenAI / vLLM parameters this engine cannot honour: refused by name ("not supported", not "unknown").
UNSUPPORTED = frozenset(
    {
        "suffix",
        "logit_bias",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "parallel_tool_calls",
        "response_format",
        "top_k",
        "min_p",
        "repetition_penalty",
        "prediction",
        "audio",
        "modalities",
        "reasoning_effort",
        "service_tier",
        "store",
        "metadata",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "use_beam_search",
        "length_penalty",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "truncate_prompt_tokens",
        "echo",
        "prompt_logprobs",
        "web_search_options",
    }
)
UNSUPPORTED_MESSAGE_FIELDS = frozenset({"name"})  # OpenAI message fields refused by name
# The P/D wiring the proxy adds to a body (``transfer_params`` types it); a client's is dropped.
WIRING = ("kv_transfer_params", "kv_transfer_params_list")
MAX_STOP = 16  # stop strings per request
MAX_N = 64  # choices per prompt
MAX_SEED = 2**63
MAX_LOGPROBS = 20  # top alternatives per token, the OpenAI chat limit
TOKEN_ID_BOUND = 2**31  # a token id in a body is below this (a vocabulary's own bound is checked on reading)
