"""kvoffload_engine: the offload engine: layerwise prefill and sparse-offload decode of a DSA model
(``dsamodel``) through kvcore, what the prefill and decode services run.

One concept per module:

- ``prefill``          ``LayerwisePrefill``: a prompt chunk by chunk and layer by layer through shared
                       device buffers (``PrefillRequest``), on the engine's one compute thread.
- ``prefill_result``   what a prefill hands over: ``ComputedPrefill``, ``PrefillResult``, ``PrefillError``.
- ``prefill_blocks``   ``PromptBlocks``: which pool object holds each prompt block (prefix cache,
                       request-scoped tails), planned chunk by chunk (``Chunk``).
- ``prefill_loader``   ``SlotLoader``: slots acquired and prefixes loaded ahead of the compute.
- ``buffers``          ``LayerBuffers``: the prefill's device layer buffers, one per physical slot.
- ``chunk_attention``  one prefill chunk's sparse attention for one layer.
- ``decode``           ``SparseDecoder``: the sparse-offload decode step over the hot top-k buffer
                       (``StepStats``).
- ``decode_requests``  ``DecodeRequests`` (``SparseDecoder``'s admission, prompt install and
                       bookkeeping) and ``DecodeSeq``.
- ``topk_override``    a given top-k in place of the indexer's, checked.
- ``prefetch``         ``MissPrefetcher``: the next layer's predicted misses loaded early.
- ``trace_topk``       ``TraceTopK``: a top-k override replaying a ``kvcore.traces.Trace``.
- ``speculative``      MTP speculative decoding and ``--speculative-config``.
- ``engine``           ``Engine``: single-process prefill -> decode, the reference for I3.
- ``build``            host pools and the prefill engine from plain settings.
- ``model_layout``     the kvcore ``KVLayout`` of a model config (``kvoffload plan`` sizes it too).
- ``tp_channel``       the ordered broadcast channel of a tensor-parallel group.
- ``tp_prefill``       tensor-parallel prefill: rank 0's ``Followers``, the others' ``follow``.
- ``tp_decode``        tensor-parallel decode (``LeadDecoder``, ``follow_decode``).
"""

__version__ = "0.1.0"
