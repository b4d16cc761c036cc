"""The proxy's prefill dispatch body -> its children: one prompt (with ``kv_transfer_params``) or a
prompt list (with ``kv_transfer_params_list``), ``n`` choices each; child = prompt * n + choice, in
the proxy's order, each with the prompt's ids, the sampling parameters of its choice (the seed the
proxy gives that choice's decode) and the decode it feeds. The body is checked by
``body.validate_body``, as every body is."""

from __future__ import annotations

from dataclasses import dataclass

from openai_api.body import RequestError, read_body, validate_body
from openai_api.request import prompt_ids
from openai_api.sampling_params import SamplingParams
from openai_api.tokenizer import Tokenizer
from openai_api.transfer_params import KVTransferParams, parse_transfer_params, parse_transfer_params_list


@dataclass(frozen=True)
class Child:
    """One (prompt, choice) of a dispatch: prefilled in turn, it answers with its first token."""

    prompt_ids: list[int]
    params: SamplingParams
    transfer: KVTransferParams | None


def parse_dispatch(raw: bytes, tokenizer: Tokenizer, *, chat: bool, max_model_len: int) -> list[Child]:
    """The dispatch's children, or a RequestError naming the field."""
    body = read_body(raw)
    request = validate_body(body, chat=chat, first_token_only=True)
    n = request.choices
    # choice j of n samples its first token with the seed the proxy gives that choice's decode
    choice_params = [request.sampling_params(choice=j) for j in range(n)]
    ids_list = [ids for ids in prompt_ids(request, tokenizer) for _ in range(n)]
    if len(ids_list) > 1 or body.get("kv_transfer_params_list") is not None:
        transfers = parse_transfer_params_list(
            body.get("kv_transfer_params_list") or [None] * len(ids_list), len(ids_list)
        )
    else:
        transfers = [parse_transfer_params(body.get("kv_transfer_params"))]
    for ids in ids_list:
        if len(ids) > max_model_len:
            raise RequestError(f"prompt of {len(ids)} tokens exceeds max_model_len={max_model_len}")
    return [Child(ids, choice_params[k % n], transfer) for k, (ids, transfer) in enumerate(zip(ids_list, transfers))]
