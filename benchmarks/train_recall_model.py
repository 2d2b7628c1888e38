"""Train a tiny Llama on cross-document associative recall, then measure blending on it (CPU, seeded).

Usage (one CPU thread, about 5 CPU-minutes; 15 minutes wall on a busy shared 2-core machine;
deterministic for a given --seed and --threads):

    .venv/bin/python benchmarks/train_recall_model.py

Writes the model (config.json + model.safetensors + task.json, under 1 MB) to
tests/fixtures/blend/recall_model/ and the accuracy table to
benchmarks/results/blend_recall.json and .md: answer accuracy with full
prefill, prefix-only caching, naive concatenation of cached document KV,
blending at each recompute ratio (top-k by K deviation at the check layer),
and random selection of the same number of tokens, split by whether the
queried key had a later distractor. See lmi_cache/blend/recall_task.py.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from lmi_cache.blend.hf_adapter import HFLayerwiseModel
from lmi_cache.blend.quality import BlendCase, QualityTally, run_conditions, standard_conditions
from lmi_cache.blend.recall_task import BOS, RecallTask, sample_prompt, training_batch

ROOT = Path(__file__).resolve().parents[1]
RATIOS = (0.0, 0.05, 0.15, 0.3, 1.0)
RANDOM_RATIOS = (0.05, 0.15, 0.3)


def build_model(task: RecallTask, seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=task.vocab_size, hidden_size=64, intermediate_size=192, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=BOS, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def train(model: Any, task: RecallTask, steps: int, batch_size: int, seed: int, lr: float) -> list[float]:
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    model.train()
    losses: list[float] = []
    for step in range(steps):
        ids, labels = training_batch(task, rng, batch_size)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 200 == 0 or step == steps - 1:
            print(f"step {step:5d}  loss {sum(losses[-50:]) / len(losses[-50:]):.4f}", flush=True)
    model.eval()
    return losses


def evaluate(model: Any, task: RecallTask, num_prompts: int, seed: int) -> dict[str, object]:
    """Accuracy and KL per condition, overall and by distractor / no distractor."""
    adapter = HFLayerwiseModel(model)
    rng = random.Random(seed)
    conditions = standard_conditions(RATIOS, RANDOM_RATIOS)
    tallies = {"all": QualityTally(), "with distractor": QualityTally(), "no distractor": QualityTally()}
    for i in range(num_prompts):
        prompt = sample_prompt(task, rng)
        case = BlendCase(
            torch.tensor([BOS]), tuple(torch.tensor(d) for d in prompt.docs), torch.tensor(prompt.tail_ids())
        )
        logits = run_conditions(adapter, case, conditions, check_layers=(1,), seed=seed + i)
        answer = prompt.questions[0][1]
        tallies["all"].add(logits, answer=answer)
        tallies["with distractor" if prompt.questions[0][2] else "no distractor"].add(logits, answer=answer)
    return {name: {"prompts": t.prompts, "rows": [asdict(r) for r in t.rows()]} for name, t in tallies.items()}


def to_markdown(result: dict[str, object]) -> str:
    ev = result["evaluation"]
    assert isinstance(ev, dict)
    lines = [
        "| condition | accuracy | with distractor | no distractor | mean KL vs full | greedy agreement |",
        "|---|---|---|---|---|---|",
    ]
    by_name = {split: {r["condition"]: r for r in ev[split]["rows"]} for split in ev}
    for name, row in by_name["all"].items():
        lines.append(
            f"| {name} | {row['accuracy']:.3f} | {by_name['with distractor'][name]['accuracy']:.3f} | "
            f"{by_name['no distractor'][name]['accuracy']:.3f} | {row['mean_kl']:.4f} | "
            f"{row['greedy_agreement']:.3f} |"
        )
    counts = ", ".join(f"{split}: {ev[split]['prompts']}" for split in ev)
    return "\n".join(lines) + f"\n\nPrompts ({counts}); check layer 1; tiny Llama trained with " \
        f"`benchmarks/train_recall_model.py` ({result['train_steps']} steps, seed {result['seed']}).\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--eval-prompts", type=int, default=400)
    parser.add_argument("--out", type=Path, default=ROOT / "tests/fixtures/blend/recall_model")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks/results/blend_recall")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    task = RecallTask()
    model = build_model(task, args.seed)
    started = time.monotonic()
    losses = train(model, task, args.steps, args.batch_size, args.seed, args.lr)
    train_s = time.monotonic() - started
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(args.out), safe_serialization=True)
    (args.out / "task.json").write_text(json.dumps(asdict(task), indent=1) + "\n")
    evaluation = evaluate(model, task, args.eval_prompts, seed=args.seed + 1_000_003)
    result = {
        "task": asdict(task), "seed": args.seed, "train_steps": args.steps, "batch_size": args.batch_size,
        "final_loss": sum(losses[-50:]) / len(losses[-50:]), "train_seconds": round(train_s, 1),
        "evaluation": evaluation,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    markdown = to_markdown(result)
    args.results.with_suffix(".md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
