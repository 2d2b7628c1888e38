"""Blending quality on CPU: first-token KL to full prefill and answer accuracy, with an ablation against a reference.

Usage (one thread; 10 to 15 minutes on a busy shared 2-core machine):

    .venv/bin/python benchmarks/bench_blend_quality.py
    .venv/bin/python benchmarks/bench_blend_quality.py --prompts 4 --recall-prompts 100 --no-ablation   # a smoke run
    .venv/bin/python benchmarks/bench_blend_quality.py --time-blend    # blend time, gradual against one check

Two models:

* a deep random-weight Llama (``--layers``, default 16; the 7M test model's
  widths), prompts of [32 prefix | 4 documents of random ids | 16 question ids];
* the trained recall model (``benchmarks/train_recall_model.py``; prompts of
  ``lmi_cache/blend/recall_task.py``), where answers can be scored.

Every document's KV is computed alone at position 0 (what the cache stores),
then blended at recompute ratios 0, 0.15 and 1.0 (top-k by K deviation, check
layer 1, gradual filtering), against random selection of as many tokens, naive
concatenation, and one check keeping the count (``gradual=False``). Reported:
the KL divergence of the first generated token's distribution from full
prefill (mean over prompts), its ratio to ratio 0, and answer accuracy.

The ablation (deep random model, same prompts) switches one piece of the
pipeline at a time: the reference implementation of the published algorithm
(``cacheblend_reference.py``: its own RoPE, attention and selection), layer 0
from each segment's stored attention (the vLLM worker's native path), K+V
deviation, the check layer's fresh KV kept only for the selected tokens, and
check layer 2. Writes benchmarks/results/blend_quality.json and .md.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from cacheblend_reference import ReferenceLlama, reference_blend
from lmi_cache.blend.blender import next_token_logits, prefill
from lmi_cache.blend.hf_adapter import HFLayerwiseModel
from lmi_cache.blend.quality import BlendCase, Condition, QualityTally, run_conditions
from lmi_cache.blend.recall_task import RecallTask, measure
from lmi_cache.devtools.tiny_model import SPECS

ROOT = Path(__file__).resolve().parents[1]
RATIO = 0.15
CONDITIONS = [
    Condition("full prefill", "full"), Condition("naive concatenation", "naive"),
    Condition("ratio 0", "blend", 0.0), Condition("ratio 0.15", "blend", RATIO), Condition("ratio 1", "blend", 1.0),
    Condition("random 0.15", "blend", RATIO, "random"), Condition("one check 0.15", "blend", RATIO, gradual=False),
]
ABLATION = [
    Condition("layer 0 from stored attention", "blend", RATIO, layer0_merge=True),
    Condition("K+V deviation", "blend", RATIO, deviation="kv"),
    Condition("K+V deviation, one check", "blend", RATIO, deviation="kv", gradual=False),
    Condition("random, one check", "blend", RATIO, "random", gradual=False),
]


def deep_random_model(layers: int, seed: int) -> Any:
    """A random float32 Llama with the 7M test model's widths and ``layers`` layers."""
    import transformers

    spec = SPECS["7m"]
    config = transformers.LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=8192, initializer_range=0.12, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).float().eval()


def first_token_kl(full: torch.Tensor, other: torch.Tensor) -> float:
    ref = torch.log_softmax(full.double(), dim=-1)
    return float((ref.exp() * (ref - torch.log_softmax(other.double(), dim=-1))).sum().clamp_min(0.0))


def random_model_figures(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """Targets and ablation tables (condition -> per-prompt first-token KL) on the deep random model."""
    model = deep_random_model(args.layers, args.seed)
    adapter, ref = HFLayerwiseModel(model), ReferenceLlama(model)
    gen = torch.Generator().manual_seed(args.seed)
    vocab = int(model.config.vocab_size)
    targets, ablation = QualityTally(), QualityTally()
    extra: dict[str, list[float]] = {}
    for i in range(args.prompts):
        case = BlendCase(torch.randint(0, vocab, (32,), generator=gen),
                         tuple(torch.randint(0, vocab, (args.doc_tokens,), generator=gen) for _ in range(4)),
                         torch.randint(0, vocab, (16,), generator=gen))
        conditions = CONDITIONS + (ABLATION if args.ablation else [])
        logits = {k: v[-1:] for k, v in run_conditions(adapter, case, conditions, seed=args.seed + i).items()}
        targets.add({c.name: logits[c.name] for c in CONDITIONS})
        if args.ablation:
            ablation.add(logits)
            for name, value in _ablation_extras(adapter, ref, case, logits["full prefill"][0]).items():
                extra.setdefault(name, []).append(value)
        print(f"random model: prompt {i + 1}/{args.prompts}", file=sys.stderr, flush=True)
    out_targets = _table(targets, "ratio 0")
    out_ablation: dict[str, Any] = {}
    if args.ablation:
        table = _table(ablation, "ratio 0")
        out_ablation = {name: table[name] for name in ["ratio 0.15", "one check 0.15", *(c.name for c in ABLATION)]}
    for name, values in extra.items():
        if name.startswith("KL "):
            kl = sum(values) / len(values)
            out_ablation[name[3:]] = {"first_token_kl": kl, "vs_ratio_0": kl / out_targets["ratio 0"]["first_token_kl"]}
        else:
            out_ablation[name] = {"value": max(values) if "largest" in name else sum(values) / len(values)}
    return out_targets, out_ablation


def _ablation_extras(adapter: HFLayerwiseModel, ref: ReferenceLlama, case: BlendCase,
                     full: torch.Tensor) -> dict[str, float]:
    """The reference's first-token KL (gradual, one check, check KV kept only for the selected) and agreement with the blender."""
    from lmi_cache.blend.blender import blend, segment_kv

    count = math.floor(RATIO * case.num_blended_tokens + 1e-9)
    gradual = {1: 2 * count, 2: int(1.5 * count), 3: count}
    out: dict[str, float] = {}
    with torch.no_grad():
        for name, keep, fresh in (("reference (published algorithm)", gradual, True),
                                  ("reference, one check", {1: count}, True),
                                  ("reference, check layer KV kept for selected only", gradual, False),
                                  ("reference, check layer 2", {layer + 1: c for layer, c in gradual.items()}, True)):
            kv, kept = reference_blend(ref, case.prefix, case.segments, keep, check_layer_all_fresh=fresh)
            out["KL " + name] = first_token_kl(full, ref.next_token_logits(kv, case.tail))
            if name.startswith("reference (published"):
                prefix_kv, _ = prefill(adapter, case.prefix)
                mine = blend(adapter, prefix_kv, case.segments, [segment_kv(adapter, s) for s in case.segments],
                             [1], [count])
                rotated = torch.stack([ref.rotate(k, kv.positions) for k in kv.k_raw])
                out["same recomputed tokens as the reference (fraction of prompts)"] = float(
                    torch.equal(kept, mine.recomputed))
                out["largest difference of a K value, blender vs reference"] = float((mine.kv.k - rotated).abs().max())
    return out


def recall_model_figures(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(args.recall_model)).float().eval()
    task = RecallTask(**json.loads((args.recall_model / "task.json").read_text()))
    tally = measure(model, task, args.recall_prompts, args.seed + 1_000_003, CONDITIONS, first_token=True)["all"]
    return _table(tally, "ratio 0")


def _table(tally: QualityTally, base: str) -> dict[str, Any]:
    rows = {r.condition: r for r in tally.rows()}
    table: dict[str, Any] = {}
    for name, row in rows.items():
        table[name] = {"first_token_kl": row.mean_kl, "vs_ratio_0": row.mean_kl / rows[base].mean_kl,
                       "accuracy": row.accuracy}
        if name != base and name != "full prefill":
            wins = tally.compare(name, base)
            table[name]["prompts_lower_kl_than_ratio_0"] = f"{wins.a_lower_kl}/{wins.prompts}"
    return table


def to_markdown(result: dict[str, Any]) -> str:
    lines = ["| model | condition | first-token KL | vs ratio 0 | accuracy | prompts with lower KL than ratio 0 |",
             "|---|---|---|---|---|---|"]
    for model_name, table in result["targets"].items():
        for name, row in table.items():
            acc = "" if row.get("accuracy") is None else f"{row['accuracy']:.3f}"
            lines.append(f"| {model_name} | {name} | {row['first_token_kl']:.4f} | {row['vs_ratio_0']:.2f}x | {acc} | "
                         f"{row.get('prompts_lower_kl_than_ratio_0', '')} |")
    if result["ablation"]:
        lines += ["", "Ablation (deep random model, ratio 0.15, same prompts):", "",
                  "| variant | first-token KL | vs ratio 0 |", "|---|---|---|"]
        for name, row in result["ablation"].items():
            if "value" in row:
                lines.append(f"| {name} | {row['value']:.3g} | |")
            else:
                lines.append(f"| {name} | {row['first_token_kl']:.4f} | {row['vs_ratio_0']:.2f}x |")
    a = result["args"]
    lines += ["", f"Deep random model: {a['layers']} layers, {a['prompts']} prompts of [32 prefix | 4 x {a['doc_tokens']} "
              f"document tokens | 16 question tokens]; recall model: {a['recall_prompts']} prompts; check layer 1; "
              f"seed {a['seed']}."]
    return "\n".join(lines) + "\n"


def time_blend(repeats: int) -> str:
    """Median blend time with gradual filtering and with one check, interleaved (8 layers, 32M widths, 4 x 2,000 tokens)."""
    import statistics
    import time

    import transformers

    from lmi_cache.blend.blender import blend, segment_kv

    spec = SPECS["32m"]
    config = transformers.LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=16384, initializer_range=0.12, tie_word_embeddings=False)
    torch.manual_seed(0)
    adapter = HFLayerwiseModel(transformers.LlamaForCausalLM(config).float().eval())
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, spec.vocab_size, (64,), generator=gen)
    segments = [torch.randint(0, spec.vocab_size, (2000,), generator=gen) for _ in range(4)]
    seconds: dict[bool, list[float]] = {True: [], False: []}
    with torch.inference_mode():
        prefix_kv, _ = prefill(adapter, prefix)
        cached = [segment_kv(adapter, s) for s in segments]
        for i in range(repeats):
            for gradual in (True, False) if i % 2 else (False, True):
                started = time.perf_counter()
                blend(adapter, prefix_kv, segments, cached, [1], [1200], include_prefix=False, gradual=gradual)
                seconds[gradual].append(time.perf_counter() - started)
    ratio = statistics.median(a / b for a, b in zip(seconds[True], seconds[False]))
    return (f"blend of 4 x 2,000 tokens at ratio 0.15 ({repeats} runs each, interleaved): gradual filtering "
            f"{statistics.median(seconds[True]):.2f} s, one check {statistics.median(seconds[False]):.2f} s "
            f"(median), {ratio:.3f}x per pair")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16, help="layers of the deep random model")
    parser.add_argument("--prompts", type=int, default=16, help="prompts on the deep random model")
    parser.add_argument("--doc-tokens", type=int, default=256)
    parser.add_argument("--recall-model", type=Path, default=ROOT / "tests/fixtures/blend/recall_model")
    parser.add_argument("--recall-prompts", type=int, default=1000)
    parser.add_argument("--no-ablation", dest="ablation", action="store_false")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks/results/blend_quality")
    parser.add_argument("--time-blend", type=int, nargs="?", const=4, metavar="RUNS",
                        help="only time blends, gradual against one check (RUNS each, default 4)")
    args = parser.parse_args(argv)
    if args.time_blend:
        torch.set_num_threads(args.threads)
        print(time_blend(args.time_blend))
        return 0
    if not (args.recall_model / "config.json").is_file():
        print(f"{args.recall_model}/config.json: no recall model there; train one with "
              "benchmarks/train_recall_model.py or pass --recall-model", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    targets, ablation = random_model_figures(args)
    result: dict[str, Any] = {
        "args": {k: (str(v.name) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "results"},
        "targets": {f"random Llama, {args.layers} layers": targets, "recall model": recall_model_figures(args)},
        "ablation": ablation,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    markdown = to_markdown(result)
    args.results.with_suffix(".md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
