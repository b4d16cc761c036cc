"""``kvoffload plan``: size a deployment from a config.json and the JSON each node is given.

Nothing runs: the model's layout comes from ``config.json`` alone (no weights; a Llama model's
``kvoffload-indexer/`` beside it gives its indexer's width and top-k), the prefill and
decode configs are validated exactly as the services would (Ascend backend names are accepted
here: sizing is not running), and the report gives, per side, the layer -> slot table, the plan's
log line, device bytes with and without offload and host-pool bytes.

The indexer cache is sized as the serving engine stores it (``dsamodel.indexcodec.indexer_cache_format``:
float8_e4m3fn keys plus float32 scales for ``DeepseekV32ForCausalLM``, ``torch_dtype`` otherwise),
in the layout the engine keeps (``kvoffload_engine.model_layout.kv_layout``). The report's
``model.indexer`` names the dtype, the scale bytes and block, and that source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsamodel.indexcodec import indexer_cache_format
from dsamodel.served import ServedConfig
from kvcore.config.decode_settings import decode_settings
from kvcore.config.errors import ConfigError
from kvcore.config.prefill_settings import prefill_settings
from kvcore.layout import KVLayout
from kvcore.pdpair import check_pd_pair
from kvcore.plan import BufferPlan
from kvoffload_engine.model_layout import kv_layout


@dataclass(frozen=True)
class Deployment:
    """What ``kvoffload plan`` is asked: the model, the sizes and each side's two JSON options."""

    config: ServedConfig
    block_size: int = 64
    max_model_len: int = 131072
    max_num_seqs: int = 8
    prefill_tp: int = 1
    decode_tp: int = 1
    decode_dp: int = 1
    prefill_kv_transfer_config: str | None = None
    prefill_additional_config: str | None = None
    decode_kv_transfer_config: str | None = None
    decode_additional_config: str | None = None


def plan_report(d: Deployment) -> dict[str, Any]:
    """The sizing report (JSON-ready): ``prefill``/``decode`` sections, ``valid``, ``errors``, ``warnings``."""
    layout = kv_layout(d.config, d.block_size)
    first = layout.layers[0]  # the report shows layer 0's row sizes
    tokens = d.max_num_seqs * -(-d.max_model_len // d.block_size) * d.block_size
    report: dict[str, Any] = {
        "model": {
            "num_hidden_layers": d.config.num_hidden_layers,
            "num_mtp_layers": d.config.num_nextn_predict_layers,
            "index_topk": d.config.index_topk,
            "main_row_kind": first.main.kind,
            "main_row_bytes": first.main.row_bytes,
            "indexer_row_bytes": first.indexer.row_bytes if first.indexer is not None else 0,
            "indexer": indexer_cache_format(d.config).describe() if d.config.index_head_dim else None,
        },
        "sizes": {"block_size": d.block_size, "max_model_len": d.max_model_len, "max_num_seqs": d.max_num_seqs},
        "errors": [],
        "warnings": [],
    }
    prefill = decode = None
    if d.prefill_kv_transfer_config is not None:
        try:
            prefill = prefill_settings(
                d.prefill_kv_transfer_config, d.prefill_additional_config, layout, tp=d.prefill_tp
            )
            report["warnings"] += [f"prefill: {w}" for w in prefill.warnings]
            report["prefill"] = _prefill_section(layout, prefill, tokens)
        except ConfigError as exc:
            report["errors"] += [f"prefill: {e}" for e in exc.errors]
    if d.decode_kv_transfer_config is not None:
        try:
            decode = decode_settings(
                d.decode_kv_transfer_config,
                d.decode_additional_config,
                layout,
                index_topk=d.config.index_topk,
                max_num_seqs=d.max_num_seqs,
                max_model_len=d.max_model_len,
                dp=d.decode_dp,
                tp=d.decode_tp,
            )
            report["warnings"] += [f"decode: {w}" for w in decode.warnings]
            report["decode"] = _decode_section(layout, decode, d)
        except ConfigError as exc:
            report["errors"] += [f"decode: {e}" for e in exc.errors]
    if prefill is not None and decode is not None:
        try:
            check_pd_pair(prefill, decode)
        except ConfigError as exc:
            report["errors"] += exc.errors
    if d.prefill_kv_transfer_config is None and d.decode_kv_transfer_config is None:
        report["errors"].append(
            "give at least one side: --prefill-kv-transfer-config and/or --decode-kv-transfer-config"
        )
    report["valid"] = not report["errors"]
    return report


def _prefill_section(layout: KVLayout, s, tokens: int) -> dict[str, Any]:
    plan = BufferPlan.build(layout, s.num_shared_buffers if s.store.use_layerwise else None, s.independent_layers)
    acc = plan.accounting(tokens // layout.block_size)
    return {
        "num_logical_layers": plan.num_logical_layers,
        "num_buffers": plan.num_buffers,
        "slots": [list(slot) for slot in plan.slots],
        "layer_to_slot": {str(k): v for k, v in sorted(plan.layer_to_slot.items())},
        "log_line": plan.log_line(),
        "prefetch_layers": s.prefetch_layers,
        "device_kv_bytes": acc.device_bytes,
        "device_kv_bytes_no_offload": acc.device_bytes_no_reuse,
        "device_kv_ratio": acc.device_ratio,
        "scale_factor": acc.scale_factor,
        "host_kv_bytes": plan.host_bytes_needed(tokens),
        "backend": s.store.backend,
        "transfer_backend": s.d2h.transfer_backend if s.d2h else None,
    }


def _decode_section(layout: KVLayout, s, d: Deployment) -> dict[str, Any]:
    tokens = -(-d.max_model_len // layout.block_size) * layout.block_size
    main = sum(layer.main.row_bytes for layer in layout.layers)
    index = sum(layer.indexer.row_bytes for layer in layout.layers if layer.indexer)
    full = d.max_num_seqs * tokens * (main + index)
    if s.sparse.enabled and not s.sparse.keep_device_kv_cache:
        device = d.max_num_seqs * (tokens * index + s.sparse.topk_buffer_size * main)
    else:
        device = full
    return {
        "num_logical_layers": layout.num_layers,
        "topk_buffer_size": s.sparse.topk_buffer_size,
        "device_kv_bytes": device,
        "device_kv_bytes_no_offload": full,
        "device_kv_ratio": device / full if full else 1.0,
        "host_kv_bytes": s.host_bytes_needed,
        "host_pool_bytes": s.host_pool_bytes,  # one pool per DP rank, shared by its TP ranks
        "host_pool_tp_ranks": s.tp,
        "host_pool_bytes_all_dp_ranks": s.host_pool_bytes * s.dp,
        "control_ports": s.control_ports(),
        "transfer_backend": s.d2h.transfer_backend,
    }


def format_report(report: dict[str, Any]) -> str:
    """Human-readable form of ``plan_report``."""
    lines = []
    ix = report["model"]["indexer"]
    scale = (
        f" + {ix['scale_bytes']} B {ix['scale_dtype']} scale (one per {ix['scale_block']} elements)"
        if ix["scale_bytes"]
        else ""
    )
    lines.append(f"indexer cache: {ix['row_bytes']} B/token = {ix['key_bytes']} B {ix['dtype']}{scale}; {ix['source']}")
    for side in ("prefill", "decode"):
        sec = report.get(side)
        if not sec:
            continue
        lines.append(f"{side}:")
        if side == "prefill":
            lines.append(f"  {sec['log_line']}")
            for s, layers in enumerate(sec["slots"]):
                lines.append(f"  slot {s:3d}: layers {layers}")
        for key in ("device_kv_bytes", "device_kv_bytes_no_offload", "host_kv_bytes"):
            lines.append(f"  {key:28s} {sec[key]:>20,d}  ({sec[key] / 2**30:.2f} GiB)")
        lines.append(f"  {'device_kv_ratio':28s} {sec['device_kv_ratio']:>20.4f}")
        if side == "decode":
            lines.append(
                f"  {'host_pool_bytes':28s} {sec['host_pool_bytes']:>20,d}  ({sec['host_pool_bytes'] / 2**30:.2f} GiB"
                f" per DP rank, one pool its {sec['host_pool_tp_ranks']} TP rank(s) share)"
            )
    for w in report["warnings"]:
        lines.append(f"warning: {w}")
    for e in report["errors"]:
        lines.append(f"error: {e}")
    lines.append("valid" if report["valid"] else "INVALID")
    return "\n".join(lines)
