"""The proxy's prefill dispatch body -> its children: one prompt (with ``kv_transfer_params``) or a
prompt list (with ``kv_transfer_params_list``), ``n`` choices each; child = prompt * n + choice, in
the proxy's order, each with the prompt's ids, the sampling parameters of its choice (the seed the
proxy gives that choice's decode) and the decode it feeds."""

from __future__ import annotations

from dataclasses import dataclass

from openai_api.body import RequestError, check_body, read_body
from openai_api.request import prompt_ids, sampling_params
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
    check_body(body, chat=chat, max_n=None)
    n = int(body.get("n") or 1)
    # choice j of n samples its first token with the seed the proxy gives that choice's decode
    choice_params = [sampling_params(body, chat=chat, choice=j, first_token_only=True) for j in range(n)]
    prompts = body.get("prompt") if not chat else None
    if (
        isinstance(prompts, list)
        and prompts
        and all(isinstance(p, (str, list)) for p in prompts)
        and not all(isinstance(p, int) for p in prompts)
    ):
        prompt_list = [prompt_ids({"prompt": p}, tokenizer, chat=False) for p in prompts]
    else:
        prompt_list = [prompt_ids(body, tokenizer, chat=chat)]
    ids_list = [ids for ids in prompt_list for _ in range(n)]
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
