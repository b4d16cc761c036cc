"""Speculative decoding with the MTP layer: one decode step over a batch, shared by the
single-process engine and the decode service, and the ``--speculative-config`` users write.

A greedy request may carry a *draft*: the MTP head's guess for the token after its next input.
One step feeds each request its next input, plus its draft if it has one, through the base layers
(``SparseDecoder.forward``: the draft's KV is written but stays out of the hot cache), then:

- samples the next input's logits; if that token equals the draft (and the request did not just
  finish), the draft is *accepted* and the draft position's logits give a bonus token, so the
  request advances two tokens in one step; otherwise the draft position is rewritten later;
- commits the final length (``commit``: one or two positions);
- runs the MTP layer over the new final positions (``mtp_forward``: its cache grows there) and
  takes its greedy guess as the next draft.

Sampled (non-greedy) requests never draft. Greedy tokens are exactly those of plain decoding (the
draft is only ever kept when the model itself chose the same token); what changes is how many
tokens a step yields. ``propose`` may be replaced (tests feed oracle drafts).

``--speculative-config`` (vLLM's format): ``{"method": "deepseek_mtp", "num_speculative_tokens": 1}``;
``method`` may also be ``"mtp"``; one speculative token is what this engine runs; unknown keys,
other methods or counts are refused with the field and the rule.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsamodel.sampling import RequestSampler

METHODS = ("deepseek_mtp", "mtp")

Propose = Callable[[str, torch.Tensor], int]  # (request id, draft logits [V]) -> draft token


@dataclass
class DraftStats:
    """Drafts verified so far and how many were accepted."""

    drafts: int = 0
    accepted: int = 0


def greedy_draft(request_id: str, draft_logits: torch.Tensor) -> int:
    """The MTP head's greedy choice."""
    return int(torch.argmax(draft_logits))


def decode_step(
    decoder,
    batch: list[tuple[str, RequestSampler]],
    next_input: dict[str, int],
    drafts: dict[str, int],
    stats: DraftStats,
    propose: Propose = greedy_draft,
) -> dict[str, list[int]]:
    """One step of ``batch`` (request id, its sampler) on ``decoder`` (a ``SparseDecoder``): returns
    the tokens each request produced (one, or two with an accepted draft), in order; updates
    ``next_input`` and ``drafts`` (module docstring). A request whose sampler finished gets no new
    draft; its ``next_input`` is its last token."""
    ids = [rid for rid, _ in batch]
    inputs = [[next_input[rid]] + ([drafts[rid]] if rid in drafts else []) for rid in ids]
    logits, h = decoder.forward(ids, inputs)  # [N, V], [N, D]
    out: dict[str, list[int]] = {}
    row = 0
    mtp_ids, mtp_pos, mtp_rows, mtp_next = [], [], [], []
    for (rid, sampler), toks in zip(batch, inputs, strict=True):
        p = decoder.seqs[rid].num_tokens
        token = sampler.step(logits[row])
        produced = [token]
        accepted = len(toks) == 2 and token == toks[1] and not sampler.finished
        stats.drafts += len(toks) == 2
        stats.accepted += accepted
        if accepted:
            token = sampler.step(logits[row + 1])  # the bonus token
            produced.append(token)
        decoder.commit(rid, p + 1 + accepted)
        next_input[rid] = token
        if drafts.pop(rid, None) is not None and not sampler.finished:
            mtp_ids.append(rid)  # grow the MTP cache over the new final positions, draft again
            mtp_pos.append([p, p + 1] if accepted else [p])
            mtp_rows += [row, row + 1] if accepted else [row]
            mtp_next.append([toks[1], token] if accepted else [token])
        out[rid] = produced
        row += len(toks)
    if mtp_ids:
        model = decoder.model
        h_prev = model.final_norm(h[torch.tensor(mtp_rows, device=h.device)])  # [M, D]
        draft_logits = decoder.mtp_forward(mtp_ids, mtp_pos, h_prev, mtp_next)  # [M, V]
        ends = torch.tensor([len(ps) for ps in mtp_pos]).cumsum(0) - 1
        for rid, lg in zip(mtp_ids, draft_logits[ends], strict=True):
            drafts[rid] = propose(rid, lg)
    return out


def parse_speculative_config(text: str | None) -> int:
    """``--speculative-config`` JSON -> speculative tokens per step (0 when not given); ValueError
    naming the field and the rule otherwise."""
    if text is None:
        return 0
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config: malformed JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--speculative-config: must be a JSON object, got {type(cfg).__name__}")
    unknown = sorted(set(cfg) - {"method", "num_speculative_tokens"})
    if unknown:
        raise ValueError(
            f"--speculative-config: unknown key(s) {', '.join(unknown)}; this decode takes method and "
            "num_speculative_tokens"
        )
    method = cfg.get("method")
    if method not in METHODS:
        raise ValueError(
            f"--speculative-config.method: got {method!r}; must be one of {', '.join(METHODS)} "
            "(drafts come from the model's MTP layer)"
        )
    n = cfg.get("num_speculative_tokens")
    if isinstance(n, bool) or n != 1:
        raise ValueError(
            f"--speculative-config.num_speculative_tokens: got {n!r}; must be 1 (one MTP draft token "
            "per step is what this engine runs)"
        )
    return 1
