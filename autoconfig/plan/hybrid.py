"""Sizing for hybrid attention / state-space models (Qwen3-Next, Granite 4 hybrid, Jamba): pure arithmetic.

Run by the planner (container-start process, or ``lmi-cache plan``). vLLM's
hybrid KV cache manager keeps attention KV and the state layers' per-request
state in one block pool: it raises the attention block size until one
attention page (block x KV of one layer) holds one layer's state, pads the
state page to that size, and groups layers in equal-sized KV cache groups.
Each rule names the vLLM 0.32 code it mirrors. With prefix caching (vLLM's
default) the state is kept at block boundaries ("align" mode), so the cache
tiers store one state per chunk boundary next to the attention KV.
"""
from __future__ import annotations

import math

from autoconfig.model.kv import hybrid_group_layers
from autoconfig.plan.types import PlanModel

# vLLM MambaSpec.max_memory_usage_bytes in "align" mode: the running state and the last boundary's.
ALIGN_STATE_BLOCKS_PER_REQUEST = 2


def hybrid_block_tokens(m: PlanModel, tp: int, base_block: int) -> int:
    """vLLM's attention block size for this model: platforms/interface.py ``_align_hybrid_block_size``.

    The smallest multiple of the backend's block (16 on CUDA, 128 on CPU) whose attention page of one layer
    is at least one layer's state page.
    """
    assert m.state is not None
    attn_page_per_token = 2 * m.layout.kv_heads_per_rank(tp) * m.layout.head_dim * m.layout.dtype_bytes
    state_page = m.state.layer_state_bytes(tp)
    return base_block * math.ceil(state_page / (base_block * attn_page_per_token))


def _layout(m: PlanModel, tp: int, block: int) -> tuple[int, int, int, int]:
    """(layers per group, attention groups, state groups, page bytes) as vLLM's hybrid manager builds them."""
    assert m.state is not None
    attn, state = m.state.num_attention_layers, m.state.num_state_layers
    group = hybrid_group_layers(attn + state, state)
    page = block * 2 * m.layout.kv_heads_per_rank(tp) * m.layout.head_dim * m.layout.dtype_bytes
    return group, math.ceil(attn / group), math.ceil(state / group), page


def hybrid_request_bytes(m: PlanModel, tp: int, block: int, max_model_len: int) -> int:
    """Pool bytes one max_model_len-long request takes on one rank (all groups share the pool)."""
    group, attn_groups, state_groups, page = _layout(m, tp, block)
    blocks = attn_groups * math.ceil(max_model_len / block) + state_groups * ALIGN_STATE_BLOCKS_PER_REQUEST
    return blocks * group * page


def hybrid_pool_tokens(m: PlanModel, tp: int, kv_bytes: int, block: int, max_model_len: int,
                       why: list[str]) -> int:
    """Tokens of max_model_len-long requests one rank's pool holds: vLLM's ``get_kv_cache_capacity``.

    num_blocks = pool bytes / (layers per group x page); one request takes cdiv(max_model_len, block)
    blocks in each attention group and ALIGN_STATE_BLOCKS_PER_REQUEST blocks in each state group.
    """
    assert m.state is not None
    group, attn_groups, state_groups, page = _layout(m, tp, block)
    num_blocks = kv_bytes // (group * page)
    per_request = attn_groups * math.ceil(max_model_len / block) + state_groups * ALIGN_STATE_BLOCKS_PER_REQUEST
    tokens = num_blocks * max_model_len // per_request
    padding = 100 * (page - m.state.layer_state_bytes(tp)) / m.state.layer_state_bytes(tp)
    why.append(
        f"hybrid pool: block_size {block} tokens (vLLM raises it until one layer's attention page, {page:,} B, holds "
        f"one layer's state, {m.state.layer_state_bytes(tp):,} B, padded by {padding:.1f}%); layers in groups of "
        f"{group} ({attn_groups} attention, {state_groups} state group(s)), {num_blocks:,} blocks of {group} x "
        f"{page:,} B; a {max_model_len:,}-token request takes {per_request:,} blocks ({attn_groups} x "
        f"cdiv({max_model_len:,}, {block}) + {state_groups} x {ALIGN_STATE_BLOCKS_PER_REQUEST} state blocks in "
        "prefix caching's align mode)"
    )
    return tokens


def state_bytes_rank(m: PlanModel, tp: int, pp: int) -> int:
    """One request's state over the state layers of the fullest pipeline stage, on one rank."""
    assert m.state is not None
    return math.ceil(m.state.num_state_layers / pp) * m.state.layer_state_bytes(tp)


def hybrid_chunk_tokens(block: int, bpt_rank: int, state_bytes: int, default_chunk: int,
                        max_chunk: int) -> tuple[int, str]:
    """(chunk tokens, why): whole blocks, grown until the state stored per chunk is at most its attention KV.

    States exist only at block boundaries, so a chunk is whole blocks. Each stored chunk also carries the
    state at its end boundary; a short chunk would store mostly state, so it grows (up to ``max_chunk``) until
    the state is at most half of what a chunk stores, at the cost of coarser hits.
    """
    chunk = block * math.ceil(default_chunk / block)
    largest = max(block, max_chunk // block * block)
    while chunk * bpt_rank < state_bytes and chunk + block <= largest:
        chunk += block
    return chunk, (f"whole hybrid blocks ({block} tokens; states exist only at block boundaries) from 256, grown "
                   f"until the chunk's attention KV ({chunk * bpt_rank:,} B) is at least the state stored with it "
                   f"({state_bytes:,} B) or the chunk reaches {largest} tokens")


def tier_bytes_per_token(m: PlanModel, tp: int, pp: int, bpt_rank: int, chunk: int, why: list[str]) -> int:
    """Bytes per token the tiers need per rank: attention KV plus one state per chunk boundary, spread over the chunk."""
    if m.state is None:
        return bpt_rank
    layers = math.ceil(m.state.num_state_layers / pp)
    state_bytes = state_bytes_rank(m, tp, pp)
    per_token = bpt_rank + math.ceil(state_bytes / chunk)
    why.append(
        f"tier bytes per token = {per_token:,} per rank: attention KV {bpt_rank:,} B + the state at each chunk "
        f"boundary ({layers} state layers x {m.state.layer_state_bytes(tp):,} B = {state_bytes:,} B) / chunk "
        f"{chunk}; a hit restores the attention KV of every chunk and the state at its last boundary"
    )
    return per_token


def hybrid_vllm_args(m: PlanModel, backend: str, block: int, chunk: int, why: list[str]) -> list[str]:
    """vLLM flags a hybrid model needs for the connector to cache its state at every chunk boundary."""
    if m.state is None:
        return []
    # vLLM retains (and offers connectors) a boundary's state only at multiples of this interval, or at a
    # prompt's end; the connector stores states at chunk ends only.
    args = ["--prefix-cache-retention-interval", str(chunk)]
    why.append(f"vllm --prefix-cache-retention-interval {chunk}: vLLM keeps the state at every chunk boundary "
               "and hands it to the connector, which stores it next to that chunk's attention KV")
    if backend == "cpu" and m.state.kind == "mamba2":
        # vLLM 0.32's CPU Mamba2 kernel cannot export a state inside a prefill step (IndexError in
        # mamba_mixer2); steps of one block end every prefill step on a boundary.
        args += ["--max-num-batched-tokens", str(block)]
        why.append(f"vllm --max-num-batched-tokens {block}: vLLM's CPU Mamba2 kernel keeps block-boundary "
                   "states only when every prefill step ends on a block")
    return args
