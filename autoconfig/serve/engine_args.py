"""The vLLM arguments serve passes after ``--model``: one list for configure's vllm_args.json and serve's argv.

Run at container start (``configure``, ``serve``, ``plan``). The connector and
settings arguments come from ``autoconfig.render.vllm_args``; every other LMI
option becomes its vLLM flag here (``autoconfig.lmi.to_vllm``), so the file
configure writes is the command serve runs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from autoconfig.lmi.properties import ResolvedProperties

if TYPE_CHECKING:
    from autoconfig.lmi.to_vllm import MappedArgs

# vLLM arguments derived from ServingSettings (the connector arguments carry them): the option
# values are not rendered a second time.
SETTINGS_ARGS = frozenset({
    "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "max_model_len",
    "gpu_memory_utilization", "kv_cache_dtype", "dtype",
})


def mapped_options(props: ResolvedProperties) -> "MappedArgs":
    """The LMI options that become vLLM arguments (not the cache's, the front door's or the recipe's own)."""
    from autoconfig.lmi.to_vllm import map_lmi_options
    from lmi_cache.front.options import FRONT_OPTIONS

    passed = {name: opt for name, opt in props.options.items()
              if name not in props.consumed and name not in FRONT_OPTIONS}
    return map_lmi_options({name: opt.value for name, opt in passed.items()},
                           {name: opt.where for name, opt in passed.items()}, num_gpus=props.settings.tp)


def engine_args(props: ResolvedProperties, args: list[str], mapped: "MappedArgs") -> list[str]:
    """The connector and settings arguments, then every other option as serve passes it to vLLM."""
    from autoconfig.lmi.to_vllm import flag_to_name

    out = list(args)
    if props.recipe is not None and props.settings.engine == "lmcache" and "--kv-transfer-config" in out:
        # Upstream LMCache through LMI's recipe keeps the user's kv_transfer_config.
        out[out.index("--kv-transfer-config") + 1] = props.recipe.upstream_json()
    names = flag_to_name()
    return out + mapped.argv(skip=SETTINGS_ARGS | frozenset(names[a] for a in args if a in names))
