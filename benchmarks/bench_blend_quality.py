"""Blending quality curve: KL divergence and greedy agreement vs full prefill over recompute ratios (CPU).

Usage:

    .venv/bin/python benchmarks/bench_blend_quality.py            # random-weight tiny models
    .venv/bin/python benchmarks/bench_blend_quality.py --recall-model tests/fixtures/blend/recall_model

Each prompt is [prefix | 4 documents | question] of random token ids; every
document's KV is computed alone at position 0 (what the cache stores), then
blended after the exact prefix at ratios 0, 0.05, 0.15, 0.3 and 1.0 (top-k by
K deviation at check layer 1), plus random selection of the same number of
tokens and naive concatenation (no recompute). Reported per condition: mean
KL(full || condition) of the next-token distribution over the question's
positions, and the fraction of those positions whose greedy token agrees with
full prefill. Random-weight models attend almost uniformly, so their curve
says little about which tokens matter; the recall model (trained by
benchmarks/train_recall_model.py) is the meaningful one.
Writes benchmarks/results/blend_quality.json and .md.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from lmi_cache.blend.hf_adapter import HFLayerwiseModel
from lmi_cache.blend.quality import BlendCase, QualityRow, QualityTally, run_conditions, standard_conditions
from lmi_cache.devtools.tiny_model import SPECS

ROOT = Path(__file__).resolve().parents[1]
RATIOS = (0.0, 0.05, 0.15, 0.3, 1.0)
RANDOM_RATIOS = (0.05, 0.15, 0.3)


def random_model(model_type: str, seed: int) -> Any:
    """A random float32 model with the shapes of the 7m tiny model (what the vLLM tests serve)."""
    import transformers

    spec = SPECS["7m"]
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[model_type]
    config = config_cls(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, max_position_embeddings=spec.max_position_embeddings,
        initializer_range=0.12, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return model_cls(config).float().eval()


def curve(model: Any, vocab: int, args: argparse.Namespace, first_id: int = 0) -> list[QualityRow]:
    adapter = HFLayerwiseModel(model)
    gen = torch.Generator().manual_seed(args.seed)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(first_id, vocab, (n,), generator=gen)

    tally = QualityTally()
    conditions = standard_conditions(RATIOS, RANDOM_RATIOS)
    for i in range(args.prompts):
        case = BlendCase(ids(args.prefix_tokens), tuple(ids(args.doc_tokens) for _ in range(args.docs)),
                         ids(args.tail_tokens))
        tally.add(run_conditions(adapter, case, conditions, check_layers=(1,), seed=args.seed + i))
    return tally.rows()


def to_markdown(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> str:
    names = list(results)
    head = "| condition | " + " | ".join(f"{n}: mean KL | {n}: greedy agreement" for n in names) + " |"
    lines = [head, "|---|" + "---|---|" * len(names)]
    for i, row in enumerate(results[names[0]]):
        cells = " | ".join(f"{results[n][i]['mean_kl']:.5f} | {results[n][i]['greedy_agreement']:.3f}" for n in names)
        lines.append(f"| {row['condition']} | {cells} |")
    return "\n".join(lines) + (
        f"\n\n{args.prompts} prompts of [{args.prefix_tokens} prefix | {args.docs} x {args.doc_tokens} document "
        f"tokens | {args.tail_tokens} question tokens], check layer 1, seed {args.seed}.\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama,qwen2", help="random-weight model types (comma-separated)")
    parser.add_argument("--recall-model", type=Path, help="also measure this trained recall model folder")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--doc-tokens", type=int, default=256)
    parser.add_argument("--prefix-tokens", type=int, default=32)
    parser.add_argument("--tail-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks/results/blend_quality")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results: dict[str, list[dict[str, Any]]] = {}
    for model_type in [m for m in args.models.split(",") if m]:
        rows = curve(random_model(model_type, args.seed), SPECS["7m"].vocab_size, args)
        results[f"random {model_type} 7m"] = [asdict(r) for r in rows]
    if args.recall_model:
        from transformers import LlamaForCausalLM

        from lmi_cache.blend.recall_task import QUERY

        model = LlamaForCausalLM.from_pretrained(str(args.recall_model)).float().eval()
        rows = curve(model, model.config.vocab_size, args, first_id=QUERY + 1)
        results["recall model (random ids)"] = [asdict(r) for r in rows]
    args.results.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("results", "recall_model")}
    settings["recall_model"] = args.recall_model.name if args.recall_model else None
    args.results.with_suffix(".json").write_text(json.dumps({"args": settings, "results": results}, indent=1) + "\n")
    markdown = to_markdown(results, args)
    args.results.with_suffix(".md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
