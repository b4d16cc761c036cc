"""kvoffload-decode: the kv_consumer — host-pool allocation, metaserver registration, per-layer pull
from the prefill, sparse-offload decode and token streaming (``kvoffload-decode``).

Modules:
- ``server``: ``serve()`` and the ``kvoffload-decode`` command
- ``options``: its flags, their checks, the validated settings and the ``SparseDecoder`` options
- ``app``: the OpenAI HTTP API (admission, metaserver registration, SSE / JSON answers)
- ``metrics``: its Prometheus ``/metrics``
- ``loop``: ``DecodeLoop``, which owns the decoder and runs the batch (gathering, sampling, cancel,
  the watchdog's verdict); its parts:
  - ``admission``: admission at once, the queue limit (``DecodeFull``), the wait for host blocks,
    the queue-wait bound kept
  - ``prefill_reports``: what the transfer path reports (news, pulled rows, the first token)
  - ``rank_poll``: TP, the polls of the follower ranks
  - ``loop_state``: ``LoopState``, the loop's state as these parts use it (declared once, typed)
- ``queue_wait``: the bound on a request's wait in the queues (the measured pace, the 429s)
- ``request``: ``DecodeRequest``, one request as the loop keeps it
- ``rows``: ``RowInstaller``, the installation of pulled rows (rank 0 and TP followers alike)
- ``transfer``: the ``Transfer`` control port (``pdlink``'s servicer over ``pull``)
- ``pull``: ``DecodeRows``, where this decode's pulls go and what it knows of waiting requests
- ``tp_ranks``: ``--tensor-parallel-size``: the TP rank processes, and a follower rank's main
- ``follower``: ``FollowerPulls``, what a TP follower knows of its requests
"""

__version__ = "0.1.0"
