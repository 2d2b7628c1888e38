"""Associative recall across documents: the synthetic task that measures blending quality on a trained model.

Runs in the training script, the quality benchmark and the tests (CPU, no
downloads). A prompt is ``[BOS] doc_1 SEP ... doc_n SEP`` followed by
questions ``Q key value``. Each document is a list of ``key value`` pairs.
A queried key is defined in one document; with probability
``distractor_prob`` a later document mentions the same key again with another
value, and the answer is still the value at the key's first mention. Telling
a first mention from a repeat needs attention from a later document back to
an earlier one: exactly what a document's cached KV, computed alone, lacks,
and what blending has to restore. (Without distractors, recall with
re-rotated RoPE needs no cross-document attention at all, so it could not
tell good blending from none.)
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

PAD, BOS, SEP, QUERY = 0, 1, 2, 3
_FIRST_FREE_ID = 4


@dataclass(frozen=True)
class RecallTask:
    """Shape of the task; token ids: 0-3 specials, then keys, then values."""

    num_keys: int = 24
    num_values: int = 24
    num_docs: int = 4
    pairs_per_doc: int = 4
    num_questions: int = 8
    distractor_prob: float = 0.5

    @property
    def vocab_size(self) -> int:
        return _FIRST_FREE_ID + self.num_keys + self.num_values

    def key_id(self, key: int) -> int:
        return _FIRST_FREE_ID + key

    def value_id(self, value: int) -> int:
        return _FIRST_FREE_ID + self.num_keys + value


@dataclass(frozen=True)
class RecallPrompt:
    """One sample: documents (each ending with SEP) and questions (key id, answer id, has_distractor)."""

    docs: tuple[tuple[int, ...], ...]
    questions: tuple[tuple[int, int, bool], ...]

    def training_ids(self) -> tuple[list[int], list[int]]:
        """Token ids of the whole sequence and the positions whose next token is an answer."""
        ids = [BOS] + [t for doc in self.docs for t in doc]
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
    """Draw one prompt; every key appears once except queried keys given a later distractor."""
    slots = task.num_docs * task.pairs_per_doc
    if slots > task.num_keys:
        raise ValueError(f"{slots} pairs need at least as many keys, got {task.num_keys}")
    keys = rng.sample(range(task.num_keys), slots)
    values = [rng.randrange(task.num_values) for _ in range(slots)]
    asked = rng.sample(range(slots), task.num_questions)
    taken = set(asked)
    questions: list[tuple[int, int, bool]] = []
    for slot in asked:
        doc = slot // task.pairs_per_doc
        later = [s for s in range((doc + 1) * task.pairs_per_doc, slots) if s not in taken]
        distractor = bool(later) and rng.random() < task.distractor_prob
        if distractor:
            other = rng.choice(later)
            taken.add(other)
            keys[other] = keys[slot]
            values[other] = rng.choice([v for v in range(task.num_values) if v != values[slot]])
        questions.append((task.key_id(keys[slot]), task.value_id(values[slot]), distractor))
    docs = []
    for d in range(task.num_docs):
        body: list[int] = []
        for s in range(d * task.pairs_per_doc, (d + 1) * task.pairs_per_doc):
            body += [task.key_id(keys[s]), task.value_id(values[s])]
        docs.append(tuple(body + [SEP]))
    return RecallPrompt(tuple(docs), tuple(questions))


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
