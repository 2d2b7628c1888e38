"""Workload generation: deterministic given a seed, prefix-stable, right shape."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmi_cache.bench.workloads import (
    VOCABULARY,
    LongDocQaSpec,
    MultiRoundChatSpec,
    chat_history_after,
    chat_opening,
    chat_round,
    document_text,
    long_doc_qa_round,
    random_words,
)

SPEC = LongDocQaSpec(num_documents=3, document_tokens=100, query_tokens=8, output_tokens=4, seed=7)


def test_same_seed_same_prompts() -> None:
    first = long_doc_qa_round(SPEC, "warmup", [80, 90, 100], 6)
    again = long_doc_qa_round(SPEC, "warmup", [80, 90, 100], 6)
    assert first == again


def test_different_seed_different_documents() -> None:
    other = LongDocQaSpec(3, 100, 8, 4, seed=8)
    ours = long_doc_qa_round(SPEC, "warmup", [80, 80, 80], 6)
    theirs = long_doc_qa_round(other, "warmup", [80, 80, 80], 6)
    assert [r.prompt for r in ours] != [r.prompt for r in theirs]


def test_independent_of_pythonhashseed() -> None:
    code = "from lmi_cache.bench.workloads import document_text; print(document_text(3, 1, 50))"
    outputs = set()
    for hash_seed in ("0", "123"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": os.getcwd()}
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        outputs.add(run.stdout)
    assert outputs == {document_text(3, 1, 50) + "\n"}


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**32), short=st.integers(1, 300), extra=st.integers(0, 300))
def test_word_streams_are_prefix_stable(seed: int, short: int, extra: int) -> None:
    longer = document_text(seed, 0, short + extra).split()
    assert len(longer) == short + extra
    assert longer[:short] == document_text(seed, 0, short).split()
    assert set(longer) <= set(VOCABULARY)


def test_query_round_reuses_documents_with_new_questions() -> None:
    warmup = long_doc_qa_round(SPEC, "warmup", [50, 60, 70], 5)
    query = long_doc_qa_round(SPEC, "query", [50, 60, 70], 5)
    for index, (w, q) in enumerate(zip(warmup, query)):
        document = document_text(SPEC.seed, index, [50, 60, 70][index])
        assert w.prompt.startswith(document + "\n") and q.prompt.startswith(document + "\n")
        assert w.prompt != q.prompt
        assert w.max_tokens == q.max_tokens == SPEC.output_tokens
    # Documents differ from one another (no accidental reuse across documents).
    assert len({r.prompt.split("\n")[0] for r in warmup}) == SPEC.num_documents


def test_round_needs_one_word_count_per_document() -> None:
    with pytest.raises(ValueError):
        long_doc_qa_round(SPEC, "warmup", [10, 10], 5)


def test_chat_history_grows_by_answer_and_question() -> None:
    spec = MultiRoundChatSpec(num_users=2, num_rounds=3, context_tokens=20, query_tokens=5, output_tokens=4, seed=1)
    histories = [chat_opening(spec, user, 15) for user in range(2)]
    assert histories[0] != histories[1]
    first = chat_round(spec, 0, histories, 4)
    answers = ["alpha beta", "gamma"]
    histories = [chat_history_after(r.prompt, a) for r, a in zip(first, answers)]
    second = chat_round(spec, 1, histories, 4)
    for r0, r1, answer in zip(first, second, answers):
        assert r1.prompt.startswith(r0.prompt + answer)
        assert len(r1.prompt) > len(r0.prompt) + len(answer)
    assert chat_round(spec, 1, histories, 4) == second


def test_random_words_counts_words() -> None:
    assert len(random_words("k", 17).split()) == 17
    assert random_words("k", 0) == ""
