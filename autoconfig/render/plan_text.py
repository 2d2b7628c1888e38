"""Human-readable ``lmi-cache plan`` output: a table, the reasons, the warnings.

Run by the CLI process. Shows AWS LMI's formula next to ours so the difference
is visible at a glance. Pure formatting; no I/O.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from autoconfig.plan.types import GIB

if TYPE_CHECKING:
    from autoconfig.plan.types import TierPlan


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:,.2f} GiB"


def _tokens(count: int) -> str:
    return f"{count:,} tokens"


def format_plan(plan: "TierPlan", host_label: str) -> str:
    """The plan as aligned text; ``host_label`` says where the host facts came from."""
    ref = plan.lmi_reference
    gpu = plan.gpu
    gpu_where = f"{gpu.num_gpus} GPU(s)" if gpu.backend == "cuda" else "vLLM CPU backend (RAM)"
    rows: list[tuple[str, str, str]] = [
        ("KV bytes/token", f"{plan.kv_bytes_per_token:,} model, {plan.kv_bytes_per_token_per_rank:,} per rank",
         "not computed"),
        ("GPU KV cache / rank", f"{_gib(gpu.kv_bytes_per_rank)}, {_tokens(gpu.kv_capacity_tokens)}", "not computed"),
        ("CPU tier / rank", _tier(plan.cpu.enabled, plan.cpu.bytes_per_rank, plan.cpu.capacity_tokens, None),
         f"{ref.cpu_gib_per_rank} GiB"),
        ("Disk tier / rank", _tier(plan.disk.enabled, plan.disk.bytes_per_rank, plan.disk.capacity_tokens,
                                   plan.disk.path),
         "n/a (no /tmp)" if ref.disk_gib_per_rank is None else f"{ref.disk_gib_per_rank} GiB at {ref.disk_path}"),
        ("Session retention", _retention(plan), "none"),
        ("Remote tier", _remote(plan), "none"),
        *([("Peer tier", _peer(plan), "none")] if plan.peer is not None else []),
        ("O_DIRECT", "yes" if plan.disk.enabled and plan.disk.use_odirect else "no", "always yes"),
        ("Chunk size", f"{plan.chunk_size} tokens (block {gpu.block_size})", "LMCache default (256)"),
        ("Ranks on this host", f"{plan.ranks_per_host} (tp {plan.tp} x pp {plan.pp} x dp {plan.dp})",
         f"divides by tp {plan.tp} only"),
    ]
    head = (f"lmi-cache plan: {plan.model_name or 'model'} ({plan.kv_dtype} KV, max_model_len "
            f"{plan.max_model_len:,}) on {gpu_where}; host from {host_label}")
    width0 = max(len(r[0]) for r in rows)
    width1 = max(len(r[1]) for r in rows + [("", "lmi-cache", "")])
    lines = [head, "", f"{'':<{width0}}  {'lmi-cache':<{width1}}  LMI formula"]
    lines += [f"{a:<{width0}}  {b:<{width1}}  {c}" for a, b, c in rows]
    lines += ["", "How each number was computed:"]
    lines += [f"  - {line}" for line in plan.explanation]
    if plan.env:
        lines += ["", "Environment for the server:"]
        lines += [f"  {key}={value}" for key, value in sorted(plan.env.items())]
    lines += ["", "vLLM arguments:", "  " + " ".join(_quote(a) for a in plan.vllm_args)]
    if plan.warnings:
        lines += ["", "Warnings:"]
        lines += [f"  ! {w}" for w in plan.warnings]
    return "\n".join(lines) + "\n"


def _retention(plan: "TierPlan") -> str:
    cpu = plan.cpu
    if not cpu.session_retention_share:
        return "off"
    return f"up to {_gib(cpu.session_retention_bytes_per_rank)} of the CPU tier (share {cpu.session_retention_share})"


def _remote(plan: "TierPlan") -> str:
    if not plan.remote_url:
        return "off (option.lmcache_remote_url)"
    from lmi_cache.remote.url import redact_url

    return f"{redact_url(plan.remote_url)}, shared by the fleet"


def _peer(plan: "TierPlan") -> str:
    assert plan.peer is not None
    return plan.peer.summary()


def _tier(enabled: bool, num_bytes: int, tokens: int, path: str | None) -> str:
    if not enabled:
        return "off"
    where = f" at {path}" if path else ""
    return f"{_gib(num_bytes)}, {_tokens(tokens)}{where}"


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)
