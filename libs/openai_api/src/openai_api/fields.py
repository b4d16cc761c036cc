"""The OpenAI request fields each endpoint accepts, the known parameters refused by name, and the
request limits: the one list the services check bodies against and the proxy validates with."""

from __future__ import annotations

# Accepted by both endpoints. kv_transfer_params(_list) are the P/D wiring the proxy adds.
COMMON_FIELDS = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "max_tokens",
        "temperature",
        "top_p",
        "n",
        "seed",
        "stop",
        "stop_token_ids",
        "presence_penalty",
        "frequency_penalty",
        "min_tokens",
        "ignore_eos",
        "user",
        "kv_transfer_params",
        "kv_transfer_params_list",
    }
)
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
MESSAGE_FIELDS = frozenset({"role", "content"})
# Known OpenAI / vLLM parameters this engine cannot honour: refused by name.
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
MAX_STOP = 16  # stop strings per request
MAX_N = 64  # choices per prompt
MAX_SEED = 2**63
MAX_LOGPROBS = 20  # top alternatives per token, the OpenAI chat limit


def refused(name: str) -> bool:
    """A known parameter this server does not honour (on this endpoint, or at all): a client is told
    "not supported" rather than "unknown"."""
    return name in UNSUPPORTED or name in COMPLETION_FIELDS or name in CHAT_FIELDS
