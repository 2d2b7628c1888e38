"""Run one vLLM (CPU) instance over a JSON job and print JSON results (a subprocess of the e2e tests).

One vLLM start serves many phases, so tests compare outputs across processes
(with and without the connector, cold and warm, before and after a restart).
The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
which lets the job read the connector's counters and inject faults.

Job (JSON file, argv[1])::

    {"model": "/path", "connector": true, "env": {"LMCACHE_CHUNK_SIZE": "256"},
     "llm_kwargs": {"max_num_batched_tokens": 256}, "patch": null,
     "phases": [{"name": "cold", "before": ["clear_engine"], "max_tokens": 8, "logprobs": 2,
                 "prompts": [{"tokens": [1, 2, 3], "salt": null,
                              "lora": {"name": "a", "id": 1, "path": "/adapter"}}]}]}

Actions in ``before``: ``clear_engine`` (drop the worker engine's contents
behind the scheduler's back: a stale index), ``corrupt_disk`` (flip a byte in
every file of the disk tier), ``flush`` (wait for disk and remote writes),
``corrupt_remote`` (flip a byte in every value of the Redis at ``LMCACHE_REMOTE_URL``),
``replace_adapter`` (copy the files of ``job["replace_adapter"]["src"]`` over those of its ``dst``). ``patch``:
``unknown_layout`` makes the worker's layout recogniser know no layout; ``mla_prefix_caching`` keeps
vLLM's own prefix caching on for an MLA model, which its CPU platform turns off (the reference for a
hit of the connector: the same split of a prompt into cached and computed tokens). ``vllm_metrics`` (optional)
names counters of vLLM's own (e.g. ``vllm:spec_decode_num_drafts``; the job's ``llm_kwargs`` must set
``disable_log_stats: false``) reported beside the connector's as ``vllm.<name>``. A prompt's ``lora`` (or null)
names the adapter it runs with (the job's ``llm_kwargs`` must enable LoRA). A prompt with
``"embeds": {"seed": 1, "rows": 600}`` instead of tokens is given as random embeddings (the job's
``llm_kwargs`` must set ``enable_prompt_embeds``). A phase with ``"chat": [[message, ...], ...]`` instead of
``prompts`` sends those OpenAI-format conversations (text, audio parts) through ``LLM.chat``, one after another.
Output: one line ``RESULT_JSON:{...}`` on stdout (with ``safety_net_firings``: planned puts the tiers of
this process refused for lack of room, which ``e2e_support.run_job`` requires to be 0).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _worker_connector() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def _scheduler_connector(llm: Any) -> Any:
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    return getattr(getattr(core, "scheduler", None), "connector", None)


def _counters(llm: Any) -> dict[str, Any]:
    counters: dict[str, Any] = {}
    worker = _worker_connector()
    side = getattr(worker, "worker_side", None)
    if side is not None:
        counters.update({f"worker.{k}": v for k, v in side.stats.snapshot().items()})
        if side.layout is not None:
            counters["worker.layout_tag"] = side.layout.tag
        if side.copier is not None:
            counters["worker.kernels"] = side.copier.backend
        engine_stats = getattr(side.engine, "stats", None)
        if callable(engine_stats):
            counters.update({f"engine.{k}": v for k, v in engine_stats().items() if isinstance(v, (int, float))})
    sched = getattr(_scheduler_connector(llm), "scheduler_side", None)
    if sched is not None:
        counters.update({f"scheduler.{k}": v for k, v in sched.stats.snapshot().items()})
        counters["scheduler.placed_digests"] = len(sched.directory.digests())
        counters["scheduler.asks_without_layout"] = sched._asks_without_layout
    return counters


def _vllm_counters(llm: Any, names: list[str]) -> dict[str, float]:
    """vLLM's own counters named in the job, summed over their labels (engines)."""
    if not names:
        return {}
    totals = dict.fromkeys(names, 0.0)
    for metric in llm.get_metrics():
        if metric.name in totals:
            totals[metric.name] += float(getattr(metric, "value", 0) or 0)
    return {f"vllm.{name}": value for name, value in totals.items()}


def _action(name: str, job: dict[str, Any]) -> None:
    side = getattr(_worker_connector(), "worker_side", None)
    if name == "clear_engine" and side is not None:
        side.engine.clear()
    elif name == "flush" and side is not None:
        side.engine.flush(30.0)
    elif name == "corrupt_disk":
        for path in sorted(Path(job["disk_dir"]).rglob("*")):
            if path.is_file() and path.stat().st_size > 4096:
                data = bytearray(path.read_bytes())
                data[len(data) // 2] ^= 0xFF
                path.write_bytes(bytes(data))
    elif name == "replace_adapter":  # new adapter files in place: same name, same path
        for source in sorted(Path(job["replace_adapter"]["src"]).iterdir()):
            (Path(job["replace_adapter"]["dst"]) / source.name).write_bytes(source.read_bytes())
    elif name == "corrupt_remote":
        import redis

        client = redis.Redis.from_url(os.environ["LMCACHE_REMOTE_URL"])
        for key in client.scan_iter():
            data = bytearray(client.get(key) or b"")
            data[len(data) // 2] ^= 0xFF
            client.set(key, bytes(data))
    else:
        raise ValueError(f"unknown action {name!r}")


def _embeds_prompt(spec: dict[str, Any], llm: Any) -> Any:
    """An embeddings-only prompt: ``rows`` random rows (seeded) of the model's hidden size, float32."""
    import torch
    from vllm.inputs import EmbedsPrompt

    hidden = llm.llm_engine.model_config.get_hidden_size()
    generator = torch.Generator().manual_seed(int(spec["seed"]))
    return EmbedsPrompt(prompt_embeds=torch.randn(int(spec["rows"]), hidden, generator=generator))


def _apply_patch(name: str | None) -> None:
    if name == "unknown_layout":
        from lmi_cache.transfer import layouts

        layouts._candidate_shapes = lambda geo, num_blocks: []  # type: ignore[assignment]
    elif name == "mla_prefix_caching":
        from vllm.platforms import current_platform

        platform = type(current_platform)
        original = platform.check_and_update_config

        def keep_prefix_caching(vllm_config: Any) -> None:
            wanted = vllm_config.cache_config.enable_prefix_caching
            original(vllm_config)
            vllm_config.cache_config.enable_prefix_caching = wanted

        platform.check_and_update_config = staticmethod(keep_prefix_caching)  # type: ignore[method-assign]


def output_record(out: Any) -> dict[str, Any]:
    completion = out.outputs[0]
    logprobs = [
        sorted([tid, lp.logprob] for tid, lp in step.items()) for step in (completion.logprobs or [])
    ]
    return {"tokens": list(completion.token_ids), "logprobs": logprobs, "num_cached_tokens": out.num_cached_tokens,
            "num_prompt_tokens": len(out.prompt_token_ids or [])}


def llm_kwargs(job: dict[str, Any], prefix_caching: bool) -> dict[str, Any]:
    """vLLM's arguments every e2e job shares (float32, eager, seeded), then the job's own ``llm_kwargs``."""
    kwargs: dict[str, Any] = {
        "model": job["model"],
        "dtype": "float32",
        "enforce_eager": True,
        "seed": 0,
        "max_model_len": 4096,
        "enable_prefix_caching": prefix_caching,
    }
    kwargs.update(job.get("llm_kwargs", {}))
    return kwargs


def run(job: dict[str, Any]) -> dict[str, Any]:
    os.environ.update({k: str(v) for k, v in job.get("env", {}).items()})
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    _apply_patch(job.get("patch"))
    kwargs = llm_kwargs(job, prefix_caching=False)
    if job.get("connector"):
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LmiCacheConnector", kv_connector_module_path="lmi_cache.vllm_connector", kv_role="kv_both"
        )
    started = time.perf_counter()
    llm = LLM(**kwargs)
    result: dict[str, Any] = {"startup_s": time.perf_counter() - started, "phases": []}
    for phase in job["phases"]:
        for action in phase.get("before", []):
            if action == "reset_prefix_cache":  # vLLM's own cache only: a repeat then hits our tiers
                assert llm.reset_prefix_cache(), "vLLM could not reset its prefix cache"
            else:
                _action(action, job)
        prompts, adapters = [], []
        for prompt in phase.get("prompts", []):
            lora = prompt.get("lora")
            adapters.append(LoRARequest(lora["name"], lora["id"], lora["path"]) if lora else None)
            item = TokensPrompt(prompt_token_ids=prompt["tokens"]) if "embeds" not in prompt else _embeds_prompt(
                prompt["embeds"], llm)
            if prompt.get("salt"):
                item["cache_salt"] = prompt["salt"]
            prompts.append(item)
        params = SamplingParams(temperature=0.0, max_tokens=phase.get("max_tokens", 8), logprobs=phase.get("logprobs", 2))
        before = _counters(llm) | _vllm_counters(llm, job.get("vllm_metrics", []))
        t0 = time.perf_counter()
        # A None entry runs that prompt on the base model (vLLM's type hint leaves it out).
        if "chat" in phase:  # one at a time, as a client sends them to a server
            outs = [out for messages in phase["chat"] for out in llm.chat(messages, params, use_tqdm=False)]
        else:
            outs = llm.generate(prompts, params, use_tqdm=False,
                                lora_request=adapters if any(adapters) else None)  # type: ignore[arg-type]
        elapsed = time.perf_counter() - t0
        after = _counters(llm) | _vllm_counters(llm, job.get("vllm_metrics", []))
        delta = {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, (int, float))}
        result["phases"].append(
            {"name": phase["name"], "elapsed_s": elapsed, "outputs": [output_record(o) for o in outs], "delta": delta, "counters": after}
        )
    return result


def main() -> int:
    job = json.loads(Path(sys.argv[1]).read_text())
    result = run(job)
    from lmi_cache.metrics.worker_series import safety_net_firings

    result["safety_net_firings"] = safety_net_firings()  # planned puts a tier refused: e2e_support asserts 0
    side = getattr(_worker_connector(), "worker_side", None)
    if side is not None and side.engine is not None:
        side.engine.flush(60.0)  # the disk tier must be complete for the next process
    sys.stdout.write("RESULT_JSON:" + json.dumps(result) + "\n")
    sys.stdout.flush()
    # vLLM's shutdown can hang on CPU; the result is already out.
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
