"""The recall task: prompts as documented (documents open with SEP, references point to earlier documents), labels aligned."""
from __future__ import annotations

import random

import pytest

from lmi_cache.blend.quality import sign_test
from lmi_cache.blend.recall_task import (
    BOS,
    QUERY,
    SEP,
    RecallTask,
    sample_prompt,
    training_batch,
)


def _statements(task: RecallTask, doc: tuple[int, ...]) -> list[tuple[str, int, int]]:
    """Decode a document's tokens into (kind, key, value or referenced key)."""
    out = []
    for token in doc[1:]:
        for key in range(task.num_keys):
            for value in range(task.num_values):
                if token == task.fact_id(key, value):
                    out.append(("fact", key, value))
            for other in range(task.num_keys):
                if token == task.ref_id(key, other):
                    out.append(("ref", key, other))
    assert len(out) == len(doc) - 1, "every document token is exactly one statement"
    return out


def test_token_ids_do_not_overlap() -> None:
    task = RecallTask()
    ids = [task.key_id(k) for k in range(task.num_keys)] + [task.value_id(v) for v in range(task.num_values)]
    ids += [task.fact_id(k, v) for k in range(task.num_keys) for v in range(task.num_values)]
    ids += [task.ref_id(k, o) for k in range(task.num_keys) for o in range(task.num_keys)]
    assert len(set(ids)) == len(ids) and min(ids) > QUERY and max(ids) == task.vocab_size - 1


def test_references_point_to_earlier_documents_and_answers_follow_them() -> None:
    task = RecallTask()
    rng = random.Random(0)
    hops_seen = set()
    for _ in range(100):
        prompt = sample_prompt(task, rng)
        assert len(prompt.docs) == task.num_docs
        assert all(len(doc) == task.pairs_per_doc + 1 and doc[0] == SEP for doc in prompt.docs)
        where: dict[int, int] = {}
        stated: dict[int, tuple[str, int]] = {}
        for d, doc in enumerate(prompt.docs):
            for kind, key, arg in _statements(task, doc):
                assert key not in stated, "each key is stated once"
                if kind == "ref":
                    assert where[arg] < d, "a reference points to a key of an earlier document"
                where[key], stated[key] = d, (kind, arg)
        for key_id, answer, hops in prompt.questions:
            key, followed = key_id - task.key_id(0), 0
            while stated[key][0] == "ref":
                key, followed = stated[key][1], followed + 1
            assert answer == task.value_id(stated[key][1]) and followed == hops
            hops_seen.add(hops)
        assert prompt.tail_ids() == [QUERY, prompt.questions[0][0]]
    assert {0, 1, 2} <= hops_seen


def test_labels_sit_on_answers_for_the_shifted_loss() -> None:
    task = RecallTask()
    ids, labels = training_batch(task, random.Random(1), 4)
    assert ids[:, 0].eq(SEP).all() and not ids.eq(BOS).any()
    for row_ids, row_labels in zip(ids.tolist(), labels.tolist()):
        answer_positions = [p for p, label in enumerate(row_labels) if label != -100]
        assert len(answer_positions) == task.num_questions
        for p in answer_positions:
            assert row_labels[p] == row_ids[p] and row_ids[p - 2] == QUERY


def test_too_many_statements_for_the_keys_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="at least as many keys"):
        sample_prompt(RecallTask(num_keys=8), random.Random(0))


def test_sign_test_is_the_exact_two_sided_binomial() -> None:
    assert sign_test(0, 0) == 1.0
    assert sign_test(3, 3) == 1.0
    assert sign_test(5, 0) == pytest.approx(2 / 32)
    assert sign_test(0, 5) == sign_test(5, 0)
    assert sign_test(60, 40) == pytest.approx(0.0569, abs=1e-3)
