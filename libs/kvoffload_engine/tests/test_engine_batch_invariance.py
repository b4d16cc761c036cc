"""A request's tokens and log-probabilities do not depend on the requests that share its batch.

The P/D stack and the single-process engine batch the same request with different neighbours (and
the plain reference decodes it alone): under `kvoffload bench load` at 256 clients some requests'
tokens differed between the two (I3), because a one-row bfloat16 product rounded otherwise than the
same row in a larger one (``dsamodel.modules.batch_rows``). Measured before the fix on the bench's
workload: the engine differed from the plain reference for 22 of 1,024 requests; after it, for none.
"""

from __future__ import annotations

import torch
from engine_support import seeded_prompt, tiny

from kvoffload_engine.engine import Engine, EngineConfig
from openai_api.sampling_params import SamplingParams

LENGTHS = (88, 198, 150, 61)  # prompt tokens of the batch's requests
MAX_TOKENS = 32


def _decode(model, prompts: list[torch.Tensor]) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and each token's log-probability, all ``prompts`` admitted at once."""
    cfg = EngineConfig(
        block_size=16, max_model_len=1024, max_num_seqs=8, prefill_pool_bytes=64 << 20, decode_pool_bytes=64 << 20
    )
    eng = Engine(model, cfg)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
        seqs = [eng.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
        while eng.waiting or eng.running:
            eng.step()
        return [(list(s.output_ids), [lp.logprob for lp in s.sampler.logprobs]) for s in seqs]
    finally:
        eng.close()


def test_each_request_decodes_the_same_alone_and_in_a_batch():
    model = tiny(torch.bfloat16)
    prompts = [seeded_prompt(n, seed=n) for n in LENGTHS]
    together = _decode(model, prompts)
    for i, prompt in enumerate(prompts):
        (alone,) = _decode(model, [prompt])
        assert len(alone[0]) == MAX_TOKENS
        assert together[i] == alone, f"request {i} ({LENGTHS[i]} prompt tokens) decoded otherwise in the batch"
