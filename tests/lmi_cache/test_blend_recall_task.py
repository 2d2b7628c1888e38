"""The recall task: prompts as documented (first mention wins, distractors later), labels aligned for training."""
from __future__ import annotations

import random

from lmi_cache.blend.recall_task import BOS, QUERY, SEP, RecallTask, sample_prompt, training_batch


def test_prompt_shape_and_first_mention_answer() -> None:
    task = RecallTask()
    rng = random.Random(0)
    seen_distractor = False
    for _ in range(200):
        prompt = sample_prompt(task, rng)
        assert len(prompt.docs) == task.num_docs
        assert all(len(doc) == 2 * task.pairs_per_doc + 1 and doc[-1] == SEP for doc in prompt.docs)
        pairs = [(doc[i], doc[i + 1]) for doc in prompt.docs for i in range(0, len(doc) - 1, 2)]
        for key, answer, distractor in prompt.questions:
            values = [v for k, v in pairs if k == key]
            assert values[0] == answer  # the first mention's value is the answer
            assert len(values) == (2 if distractor else 1)
            if distractor:
                assert values[1] != answer
                seen_distractor = True
        assert prompt.tail_ids() == [QUERY, prompt.questions[0][0]]
    assert seen_distractor


def test_labels_sit_on_answers_for_the_shifted_loss() -> None:
    task = RecallTask()
    ids, labels = training_batch(task, random.Random(1), 4)
    assert ids[:, 0].eq(BOS).all()
    for row_ids, row_labels in zip(ids.tolist(), labels.tolist()):
        answer_positions = [p for p, label in enumerate(row_labels) if label != -100]
        assert len(answer_positions) == task.num_questions
        for p in answer_positions:
            assert row_labels[p] == row_ids[p] and row_ids[p - 2] == QUERY
