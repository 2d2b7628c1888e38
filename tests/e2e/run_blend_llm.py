"""Run one vLLM (CPU) instance with LmiCacheConnector, blending on, over a JSON job; print JSON results (e2e subprocess).

Like ``run_llm.py`` (one start, many phases, engine core in this process so the
connector's counters can be read), plus per-prompt ``kv_transfer_params``, the
blending counters of both connector halves, and ``"reset_prefix_cache": true`` on
a phase to empty vLLM's own prefix cache before it (so the chunk cache serves).

Job (JSON file, argv[1])::

    {"model": "/path", "env": {"LMCACHE_CONFIG_FILE": "/path/lmcache.yaml"}, "llm_kwargs": {...},
     "phases": [{"name": "seed", "max_tokens": 8, "logprobs": 2, "reset_prefix_cache": false,
                 "prompts": [{"tokens": [1, 2, 3], "salt": null, "params": {"blend_recompute_ratios": [1.0]}}]}]}

Output: one line ``RESULT_JSON:{...}`` on stdout.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from run_llm import llm_kwargs, output_record  # this folder is on sys.path: both run as scripts from it


def _connectors(llm: Any) -> tuple[Any, Any]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    worker = get_kv_transfer_group() if has_kv_transfer_group() else None
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    scheduler = getattr(getattr(core, "scheduler", None), "connector", None)
    return worker, scheduler


def _counters(llm: Any) -> dict[str, Any]:
    worker, scheduler = _connectors(llm)
    counters: dict[str, Any] = {}
    side = getattr(worker, "worker_side", None)
    if side is not None:
        counters.update({f"worker.{k}": v for k, v in side.stats.snapshot().items()})
    blending = getattr(worker, "blending", None)
    if blending is not None and blending.worker is not None:
        counters.update({f"blend_worker.{k}": v for k, v in blending.worker.stats.snapshot().items()})
        counters["blend_worker.model_source"] = blending.model_source
    blend_sched = getattr(getattr(scheduler, "blending", None), "scheduler", None)
    if blend_sched is not None:
        counters.update({f"blend_scheduler.{k}": v for k, v in blend_sched.stats.snapshot().items()})
    sched = getattr(scheduler, "scheduler_side", None)
    if sched is not None:
        counters.update({f"scheduler.{k}": v for k, v in sched.stats.snapshot().items()})
        # Stores the directory never planned (segments and layer-0 objects are placed like chunks): 0.
        counters["scheduler.unplanned_stores"] = sum(
            sample.value for family in sched.directory.metrics.registry.collect() for sample in family.samples
            if sample.name == "lmi_cache_placement_unplanned_stores_total")
    return counters


def run(job: dict[str, Any]) -> dict[str, Any]:
    os.environ.update({k: str(v) for k, v in job.get("env", {}).items()})
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs = llm_kwargs(job, prefix_caching=True)
    kwargs.setdefault("kv_transfer_config", KVTransferConfig(
        kv_connector="LmiCacheConnector", kv_connector_module_path="lmi_cache.vllm_connector", kv_role="kv_both"
    ))
    started = time.perf_counter()
    llm = LLM(**kwargs)
    result: dict[str, Any] = {"startup_s": time.perf_counter() - started, "phases": []}
    for phase in job["phases"]:
        prompts, params = [], []
        for prompt in phase["prompts"]:
            item = TokensPrompt(prompt_token_ids=prompt["tokens"])
            if prompt.get("salt"):
                item["cache_salt"] = prompt["salt"]
            prompts.append(item)
            extra = {"kv_transfer_params": prompt["params"]} if prompt.get("params") else None
            params.append(SamplingParams(temperature=0.0, max_tokens=phase.get("max_tokens", 8),
                                         logprobs=phase.get("logprobs", 2), extra_args=extra))
        if phase.get("reset_prefix_cache"):
            assert llm.reset_prefix_cache(), "vLLM did not reset its prefix cache"
        before = _counters(llm)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        after = _counters(llm)
        delta = {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, (int, float))}
        records = [output_record(out) for out in outs]
        result["phases"].append({"name": phase["name"], "elapsed_s": elapsed, "outputs": records, "delta": delta,
                                 "counters": after})
    return result


def main() -> int:
    job = json.loads(Path(sys.argv[1]).read_text())
    result = run(job)
    from lmi_cache.metrics.worker_series import safety_net_firings

    result["safety_net_firings"] = safety_net_firings()  # planned puts a tier refused (test_blend_e2e asserts 0)
    sys.stdout.write("RESULT_JSON:" + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # vLLM's shutdown can hang on CPU; the result is already out.


if __name__ == "__main__":
    raise SystemExit(main())
