"""A vLLM server's prompt KV, block by block, as two places hold it: a store connector's pool objects
(read from this process through the pool's MetaStore and its shared-memory segment) and a decode's
``kv_digests`` log line (``kvoffload_vllm.kv_digest``). A pool object's plane is a block's page bytes
of one layer, exactly as vLLM's cache holds it, so the two compare digest for digest."""

from __future__ import annotations

import ast
import re

import torch

from kvcore.pool.block_keys import block_keys
from kvcore.pool.segment import SharedSegment
from kvoffload_vllm.kv_digest import pages_digest
from poolbackends.client import MetaStoreClient

_MODEL_ID = re.compile(r"kvoffload_store_connector\b.*?\bmodel_id=(\S+)")
_PULLED = re.compile(r"kvoffload_d2h_pulled\b.*")


def model_id(server_log: str) -> str:
    """The store connector's model id (its block keys' namespace), from the server's log."""
    found = _MODEL_ID.findall(server_log)
    assert found, "no kvoffload_store_connector line in the server's log"
    return found[-1].strip("'\"")


def pool_pages(metastore: str, model: str, prompt: list[int], block_size: int, layers: int) -> list[torch.Tensor]:
    """Per layer, ``[full blocks, page_bytes]``: the prompt's full blocks from the pool (a copy); every
    block must be there, complete."""
    keys = block_keys(model, prompt, block_size)
    with MetaStoreClient(metastore) as client:
        locations, records = client.lookup(keys)
    assert len(locations) == len(keys) and all(loc.complete for loc in locations), (len(keys), locations)
    (pool_id,) = {loc.pool_id for loc in locations}  # one store: one pool
    segment = SharedSegment.attach(records[pool_id].segment_name)
    try:
        ids = torch.tensor([loc.block_id for loc in locations], dtype=torch.long)
        return [segment.plane(p)[ids].reshape(len(keys), -1).clone() for p in range(layers)]
    finally:
        segment.close()


def pages_digests(pages: list[torch.Tensor], first: int, stop: int) -> list[str]:
    """Each layer's digest of blocks ``[first, stop)``, as a decode's ``kv_digests`` has it."""
    return [pages_digest(p[first:stop]) for p in pages]


def pulled_digests(decode_log: str, tokens: int) -> tuple[list[str], tuple[int, int]]:
    """(per layer digest, the blocks digested) of the decode's last pull of a ``tokens``-token prompt."""
    found = []
    for line in _PULLED.findall(decode_log):
        if re.search(rf"\btokens={tokens}\b", line) and "kv_digests=" in line:
            digests = ast.literal_eval(re.search(r"kv_digests=(\[[^\]]*\])", line).group(1))
            ((first, stop),) = ast.literal_eval(re.search(r"kv_digest_blocks=(\[\(.*?\)\])", line).group(1))
            found.append((digests, (first, stop)))
    assert found, f"no kvoffload_d2h_pulled line with kv_digests for {tokens} tokens in the decode's log"
    return found[-1]
