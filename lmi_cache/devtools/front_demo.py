"""A model directory that exercises the LMI front door: tiny model, cache on, sessions, LoRA adapters.

Used by the front's end-to-end test and its soak benchmark (test/benchmark
process). The directory holds a serving.properties derived from the
cpu-tiny-demo example (cache on, vLLM's prefix cache off) plus LoRA on and
the session settings, and an ``adapters/`` folder with two tiny random
adapters (``tenant-a``, ``tenant-b``) and a broken one (``broken``).
"""
from __future__ import annotations

from pathlib import Path

from lmi_cache.devtools.tiny_lora import make_broken_lora, make_tiny_lora

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "serving.properties.d" / "cpu-tiny-demo" / "serving.properties"
ADAPTERS = ("tenant-a", "tenant-b")


def make_front_model_dir(model_dir: Path, tiny_model: Path, sessions_dir: Path, session_ttl_s: int = 1200,
                         extra: list[str] | None = None, cache: bool = True) -> Path:
    """Write ``model_dir`` (serving.properties + adapters/) for ``tiny_model``; returns it.

    ``cache=False`` serves without lmi-cache (a control for comparisons).
    """
    model_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"option.model_id={tiny_model}" if line.startswith("option.model_id=") else line
             for line in EXAMPLE.read_text(encoding="utf-8").splitlines()]
    if not cache:
        lines = [line for line in lines if not line.startswith("option.lmcache_")]
    overridden = {line.split("=", 1)[0] for line in extra or []}
    lines = [line for line in lines if line.split("=", 1)[0] not in overridden]
    lines += ["option.enable_lora=true", "option.max_lora_rank=8", "option.max_loras=2",
              f"option.sessions_expiration={session_ttl_s}", f"option.sessions_path={sessions_dir}", *(extra or [])]
    (model_dir / "serving.properties").write_text("\n".join(lines) + "\n", encoding="utf-8")
    for seed, name in enumerate(ADAPTERS, start=1):
        make_tiny_lora(tiny_model, model_dir / "adapters" / name, seed=seed)
    make_broken_lora(model_dir / "adapters" / "broken")
    return model_dir
