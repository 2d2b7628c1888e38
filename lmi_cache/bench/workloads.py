"""Benchmark workloads: long-document QA and multi-round chat prompts (pure).

Runs in the ``lmi-cache bench`` process. Nothing here does I/O: texts are made
of random words from a fixed vocabulary, drawn from ``random.Random`` seeded by
a string (hashed with SHA-512 by the stdlib, so independent of
PYTHONHASHSEED), which makes every prompt a function of the seed and the word
counts alone. The runner measures how many words make the wanted number of
tokens with the server's tokenizer and passes word counts in.

Word streams are prefix-stable: the first ``n`` words of a text are the same
whatever total length is asked for, so fitting a length never changes content.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

# Plain lowercase English words: a byte-level BPE trained on any English-ish
# text splits them into one or two tokens, so word counts track token counts.
VOCABULARY: tuple[str, ...] = tuple(
    """
    about above across after again against almost along also always among animal answer
    apple area around asked away back basic became before began behind being below best
    better between black blue board body book both bring brown build built busy call
    came cannot car care carry cause center change check child city class clear close
    cold color come common complete could country course cover cross current cut dark
    data day deep did different direction distance does done door down draw dream drive
    during each early earth east easy edge effect eight either end energy enough even
    event every example face fact fall family far farm fast father feel field figure
    fill final find fine fire first fish five floor follow food foot force form found
    four free friend front full game garden gave general girl give glass gold good
    govern great green ground group grow half hand happen hard have head hear heart
    heat heavy help here high hold home horse hour house hundred idea important inch
    inside island just keep kind king know land large last late laugh lead learn leave
    left less letter level light line list little live long look machine made main
    make many map mark match matter mean measure meet method middle might mile mind
    minute miss modern moment money month moon more morning most mother mountain move
    music name nation natural near need never new next night north note nothing notice
    number object ocean offer office often open order other over page paint paper part
    pass past pattern people perhaps period person picture piece place plain plan plant
    play point port pose power press price problem produce product public pull question
    quick quiet rain reach read ready real reason record region remember rest result
    return river road rock room round rule safe said same sample school science sea
    season second section seed sense sentence serve set settle seven shape share ship
    short should show side sign simple since single size skin sleep slow small snow soft
    soil some song sound south space speak special speed spring square stand star start
    state station stay step still stone stood story straight street strong student
    study such summer sun support sure surface system table take talk teach team tell
    test than thank their them then there these thing think those though thought three
    through time today together told tone took tool total toward town track trade train
    travel tree true try turn under unit until upon usual valley value very voice wait
    walk wall warm watch water wave weather week weight west wheel where which while
    white whole wide wild wind window winter wish without wonder wood word work world
    would write year young
    """.split()
)

# Rough tokens per vocabulary word when no tokenizer is reachable.
APPROX_TOKENS_PER_WORD = 1.3


def random_words(key: str, num_words: int) -> str:
    """``num_words`` space-separated vocabulary words drawn from the stream ``key``."""
    rng = random.Random(key)
    return " ".join(rng.choice(VOCABULARY) for _ in range(num_words))


def approx_num_words(num_tokens: int) -> int:
    """Words to draw for about ``num_tokens`` tokens (at least one)."""
    return max(1, round(num_tokens / APPROX_TOKENS_PER_WORD))


@dataclass(frozen=True)
class PromptRequest:
    """One completion to send: ``request_id`` names it in results."""

    request_id: str
    prompt: str
    max_tokens: int


@dataclass(frozen=True)
class LongDocQaSpec:
    """N documents of L tokens, a warm-up round then a query round over them."""

    num_documents: int
    document_tokens: int
    query_tokens: int
    output_tokens: int
    seed: int = 0


def document_key(seed: int, doc_index: int) -> str:
    return f"lmi-bench:{seed}:document:{doc_index}"


def question_key(seed: int, round_name: str, index: int) -> str:
    return f"lmi-bench:{seed}:question:{round_name}:{index}"


def document_text(seed: int, doc_index: int, num_words: int) -> str:
    return random_words(document_key(seed, doc_index), num_words)


def question_text(seed: int, round_name: str, index: int, num_words: int) -> str:
    return random_words(question_key(seed, round_name, index), num_words)


def qa_prompt(document: str, question: str) -> str:
    # The document leads so that the repeated part is a prompt prefix, which is
    # what prefix caches (vLLM's and ours) can reuse.
    return f"{document}\n\nQuestion: {question}?\nAnswer:"


def long_doc_qa_round(
    spec: LongDocQaSpec, round_name: str, document_words: list[int], query_words: int
) -> list[PromptRequest]:
    """The requests of one round: each document with a question of this round."""
    if len(document_words) != spec.num_documents:
        raise ValueError(f"need {spec.num_documents} document word counts, got {len(document_words)}")
    requests = []
    for index, num_words in enumerate(document_words):
        prompt = qa_prompt(
            document_text(spec.seed, index, num_words),
            question_text(spec.seed, round_name, index, query_words),
        )
        requests.append(PromptRequest(f"{round_name}/doc{index}", prompt, spec.output_tokens))
    return requests


@dataclass(frozen=True)
class MultiRoundChatSpec:
    """U users; each turn resends the whole history plus a new question."""

    num_users: int
    num_rounds: int
    context_tokens: int
    query_tokens: int
    output_tokens: int
    seed: int = 0


def chat_context_key(seed: int, user: int) -> str:
    return f"lmi-bench:{seed}:chat-context:{user}"


def chat_question_key(seed: int, user: int, round_index: int) -> str:
    return f"lmi-bench:{seed}:chat-question:{user}:{round_index}"


def chat_opening(spec: MultiRoundChatSpec, user: int, context_words: int) -> str:
    """The start of user ``user``'s history: a user-specific context."""
    context = random_words(chat_context_key(spec.seed, user), context_words)
    return f"Context for user {user}: {context}\n"


def chat_turn_prompt(history: str, question: str) -> str:
    return f"{history}User: {question}?\nAssistant:"


def chat_history_after(prompt: str, answer: str) -> str:
    """History for the next turn: this turn's prompt plus the model's answer."""
    return f"{prompt}{answer}\n"


def chat_round(
    spec: MultiRoundChatSpec, round_index: int, histories: list[str], query_words: int
) -> list[PromptRequest]:
    """The requests of one chat round, one per user, given each user's history."""
    if len(histories) != spec.num_users:
        raise ValueError(f"need {spec.num_users} histories, got {len(histories)}")
    requests = []
    for user, history in enumerate(histories):
        question = random_words(chat_question_key(spec.seed, user, round_index), query_words)
        requests.append(
            PromptRequest(f"round{round_index}/user{user}", chat_turn_prompt(history, question), spec.output_tokens)
        )
    return requests
