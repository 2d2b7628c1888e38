"""Recall through references across documents: the synthetic task that measures blending quality on a trained model.

Runs in the training script, the quality benchmark and the tests (CPU, no
downloads). A prompt is ``SEP doc_1 ... SEP doc_n`` followed by questions
``Q key value``. Every document token states one key: either a fact
``key=value`` or a reference ``key=other`` ("key has the value of other"),
where ``other`` is a key stated in an earlier document, possibly a reference
itself. A question asks a key; the answer is its value, following references
back to a fact.

What a reference resolves to is only known by attending to an earlier
document: exactly what a document's cached KV, computed alone, lacks, and
what blending has to restore. The trained model keeps using it in the layers
after blending's check layer (recomputing no token past it loses about a
tenth of the reference questions), so the choice of tokens to recompute
matters.

Why this shape: each key and each statement is one token, so a tiny model
learns to match them in a few CPU-minutes (a key and a value as separate
tokens needs an induction circuit, which did not form in that time). Every
document opens with SEP, so its first token is the same whether its KV is
computed alone or in the prompt: a tiny model parks idle attention on a
sequence's first token, and with a different one alone every cached token
deviated, whether it mattered or not. A first-mention-wins rule over repeated
keys was tried too: the model answered it from the question alone (naive
reuse of cached KV lost nothing), so it could not tell good blending from none.
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmi_cache.blend.hf_adapter import HFLayerwiseModel
from lmi_cache.blend.quality import BlendCase, Condition, QualityTally, run_conditions

PAD, BOS, SEP, QUERY = 0, 1, 2, 3  # BOS is not used by the prompts (see above); kept for the config
_FIRST_FREE_ID = 4
SPLITS = ("all", "direct", "through references")


@dataclass(frozen=True)
class RecallTask:
    """Shape of the task; token ids: 0-3 specials, then keys, values, facts (key x value), references (key x key)."""

    num_keys: int = 16
    num_values: int = 8
    num_docs: int = 4
    pairs_per_doc: int = 4
    num_questions: int = 8
    ref_prob: float = 0.6

    @property
    def vocab_size(self) -> int:
        return _FIRST_FREE_ID + self.num_keys + self.num_values + self.num_keys * (self.num_values + self.num_keys)

    def key_id(self, key: int) -> int:
        """The token a question names a key with."""
        return _FIRST_FREE_ID + key

    def value_id(self, value: int) -> int:
        """The token of an answer."""
        return _FIRST_FREE_ID + self.num_keys + value

    def fact_id(self, key: int, value: int) -> int:
        """The document token ``key=value``."""
        return _FIRST_FREE_ID + self.num_keys + self.num_values + key * self.num_values + value

    def ref_id(self, key: int, other: int) -> int:
        """The document token ``key=other`` (``key`` has the value of the earlier ``other``)."""
        base = _FIRST_FREE_ID + self.num_keys + self.num_values + self.num_keys * self.num_values
        return base + key * self.num_keys + other


@dataclass(frozen=True)
class RecallPrompt:
    """One sample: documents (each opening with SEP) and questions (key id, answer id, references followed)."""

    docs: tuple[tuple[int, ...], ...]
    questions: tuple[tuple[int, int, int], ...]

    def training_ids(self) -> tuple[list[int], list[int]]:
        """Token ids of the whole sequence and the positions whose next token is an answer."""
        ids = [t for doc in self.docs for t in doc]
        answer_at: list[int] = []
        for key, answer, _ in self.questions:
            ids += [QUERY, key]
            answer_at.append(len(ids) - 1)
            ids.append(answer)
        return ids, answer_at

    def tail_ids(self) -> list[int]:
        """The first question without its answer: the part after the blended documents."""
        return [QUERY, self.questions[0][0]]


def sample_prompt(task: RecallTask, rng: random.Random) -> RecallPrompt:
    """Draw one prompt: distinct keys; in documents after the first, each is a reference with ``ref_prob``."""
    slots = task.num_docs * task.pairs_per_doc
    if slots > task.num_keys:
        raise ValueError(f"{slots} statements need at least as many keys, got {task.num_keys}")
    if task.num_questions > slots:
        raise ValueError(f"{task.num_questions} questions need as many statements, got {slots}")
    keys = rng.sample(range(task.num_keys), slots)
    value: dict[int, int] = {}
    hops: dict[int, int] = {}
    docs = []
    for d in range(task.num_docs):
        earlier = list(value)  # keys of earlier documents only: every reference crosses a document boundary
        body: list[int] = []
        for key in keys[d * task.pairs_per_doc : (d + 1) * task.pairs_per_doc]:
            if earlier and rng.random() < task.ref_prob:
                other = rng.choice(earlier)
                value[key], hops[key] = value[other], hops[other] + 1
                body.append(task.ref_id(key, other))
            else:
                value[key], hops[key] = rng.randrange(task.num_values), 0
                body.append(task.fact_id(key, value[key]))
        docs.append(tuple([SEP] + body))
    asked = rng.sample(keys, task.num_questions)
    questions = tuple((task.key_id(k), task.value_id(value[k]), hops[k]) for k in asked)
    return RecallPrompt(tuple(docs), questions)


def training_batch(task: RecallTask, rng: random.Random, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids [B, T] and labels [B, T] (-100 except at answers), for transformers' causal LM loss.

    Labels sit on the answer tokens themselves: transformers shifts them, so the logits
    after each question's key are trained to predict its answer.
    """
    rows, labels = [], []
    for _ in range(batch_size):
        ids, answer_at = sample_prompt(task, rng).training_ids()
        label = [-100] * len(ids)
        for pos in answer_at:
            label[pos + 1] = ids[pos + 1]
        rows.append(ids)
        labels.append(label)
    return torch.tensor(rows), torch.tensor(labels)


def measure(model: Any, task: RecallTask, num_prompts: int, seed: int, conditions: Sequence[Condition],
            check_layers: Sequence[int] = (1,), first_token: bool = False) -> dict[str, QualityTally]:
    """Tallies of each condition on fresh prompts, per split (``SPLITS``: all, direct facts, through references).

    A prompt's documents are the blended segments (no prefix: the prompt opens with the first
    document) and its first question without the answer is the tail. ``model``: a transformers
    Llama; random selection draws with ``seed`` + the prompt's index. ``first_token``: the KL
    and greedy agreement of the answer's position only (else every position of the tail).
    """
    adapter = HFLayerwiseModel(model)
    rng = random.Random(seed)
    tallies = {split: QualityTally() for split in SPLITS}
    for i in range(num_prompts):
        prompt = sample_prompt(task, rng)
        case = BlendCase(
            torch.zeros(0, dtype=torch.long), tuple(torch.tensor(d) for d in prompt.docs),
            torch.tensor(prompt.tail_ids()),
        )
        logits = run_conditions(adapter, case, conditions, check_layers=check_layers, seed=seed + i)
        if first_token:
            logits = {name: lg[-1:] for name, lg in logits.items()}
        _, answer, hops = prompt.questions[0]
        tallies["all"].add(logits, answer=answer)
        tallies["through references" if hops else "direct"].add(logits, answer=answer)
    return tallies
