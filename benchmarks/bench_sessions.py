"""Session retention on a multi-round chat under cache pressure: TTFT per round with and without it, side by side.

Runs as a script: ``python benchmarks/bench_sessions.py [--sessions 12] [--rounds 8] [--model 32m]``.

The workload: ``--sessions`` stateful sessions (LMI ``NEW_SESSION`` on
``/invocations`` through the front door) hold a chat each. Every round, each
session in turn appends a user turn to its conversation and re-sends the
whole conversation (``max_tokens=1``: the answer time is the time to the
first token), then appends a fixed assistant answer; the same token ids in
both runs (seeded). The CPU tier holds well under the sessions' conversations
(``--tier-fraction`` of the last round's total KV), vLLM's own prefix cache is
off, and there is no disk tier: what the CPU tier keeps is all that can hit.
Sessions taking turns through a tier smaller than their working set is LRU's
worst case: each round evicts what the next round needs.

Two vLLM servers run side by side on the same model, tier size and requests:
``extra_config.session_retention_share`` 0 (retention off: plain LRU) and the
given share (default 0.5, the planned default). Each request goes to both, one
after the other (which goes first alternates, with a short pause before each
so that neither server's threads are still busy), so only one request is ever
in flight and a slow spell of a shared machine hits both alike. Prints per
round the mean cached prompt tokens and the median TTFT of each, and the median
of the per-request TTFT ratios on/off; then the same over all later rounds and
over the rounds where plain LRU hit nothing. ``--trials`` repeats the workload
with new sessions on the same servers for more pairs.
"""
from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SESSION_HEADER = "X-Amzn-SageMaker-Session-Id"
CHUNK_TOKENS = 256
FIRST_SPECIAL_IDS = 16  # leave the tokenizer's special ids alone


@dataclass(frozen=True)
class Workload:
    sessions: int
    rounds: int
    first_turn_tokens: int
    user_turn_tokens: int
    answer_tokens: int
    seed: int

    def turns(self, session: int, trial: int = 0) -> list[tuple[list[int], list[int]]]:
        """Per round: (user turn ids, assistant answer ids) of one session, the same in every run."""
        rng = random.Random((self.seed * 1_009 + trial) * 100_003 + session)
        vocab = range(FIRST_SPECIAL_IDS, 4096)
        out = []
        for round_no in range(self.rounds):
            user = [rng.choice(vocab) for _ in range(self.first_turn_tokens if round_no == 0 else self.user_turn_tokens)]
            out.append((user, [rng.choice(vocab) for _ in range(self.answer_tokens)]))
        return out

    @property
    def last_prompt_tokens(self) -> int:
        return self.first_turn_tokens + (self.rounds - 1) * (self.user_turn_tokens + self.answer_tokens)


@dataclass
class RunResult:
    share: float
    ttft_s: list[list[float]] = field(default_factory=list)  # per round, per session
    cached_tokens: list[list[int]] = field(default_factory=list)


class Client:
    """HTTP to one server: a fresh connection per request, opened before the clock starts.

    (A kept-alive one would be closed by the server while the other server works for seconds.)
    """

    def __init__(self, url: str) -> None:
        parsed = urlparse(url)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port

    def post(self, payload: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[float, dict[str, str], Any]:
        body = json.dumps(payload).encode()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=300)
        conn.connect()
        try:
            start = time.perf_counter()
            conn.request("POST", "/invocations", body, {"Content-Type": "application/json", **(headers or {})})
            reply = conn.getresponse()
            data = reply.read()
            elapsed = time.perf_counter() - start
        finally:
            conn.close()
        if reply.status != 200:
            raise RuntimeError(f"POST /invocations -> {reply.status}: {data[:300]!r}")
        headers = {k.lower(): v for k, v in reply.getheaders()}
        # Session requests answer plain text ("Session <id> created").
        return elapsed, headers, json.loads(data) if headers.get("content-type", "").startswith("application/json") else data


def kv_bytes_per_token(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4  # K and V, float32


def server_spec(model_dir: Path, work: Path, workload: Workload, cpu_gib: float, share: float) -> Any:
    from lmi_cache.bench.vllm_server import OUR_CONNECTOR, ServerSpec
    from lmi_cache.front.options import MIDDLEWARE

    work.mkdir(parents=True)
    config = work / "lmi-cache.yaml"
    config.write_text(json.dumps({
        "chunk_size": CHUNK_TOKENS, "local_cpu": True, "max_local_cpu_size": cpu_gib, "max_local_disk_size": 0,
        "extra_config": {"session_retention_share": share},
    }))
    env = {"SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "true", "SAGEMAKER_SESSIONS_PATH": str(work / "sessions"),
           "SAGEMAKER_SESSIONS_EXPIRATION": "3600"}
    return ServerSpec(model_dir, max_model_len=max(4096, workload.last_prompt_tokens + 64), kvcache_space_gib=1,
                      kv_transfer_config=OUR_CONNECTOR, lmcache_config_file=config, extra_env=env,
                      extra_args=["--middleware", MIDDLEWARE, "--enable-prompt-tokens-details"])


def run_side_by_side(model_dir: Path, work: Path, workload: Workload, cpu_gib: float, share: float,
                     trials: int, pause_s: float) -> tuple[RunResult, RunResult]:
    """Both servers up at once; each request goes to both, one after the other (order alternating).

    Only one request is in flight at a time, so the two servers never compete for the cores during a
    measurement, and a slow spell of a shared machine hits both runs alike. Each trial is a new set of
    sessions (new conversations) on the same servers; the last trial's sessions were closed before.
    """
    from lmi_cache.bench.vllm_server import VllmServer

    off, on = RunResult(0.0), RunResult(share)
    for result in (off, on):
        result.ttft_s = [[] for _ in range(workload.rounds)]
        result.cached_tokens = [[] for _ in range(workload.rounds)]
    with contextlib.ExitStack() as stack:
        runs = []
        for result in (off, on):
            spec = server_spec(model_dir, work / f"share-{result.share}", workload, cpu_gib, result.share)
            server = stack.enter_context(VllmServer(spec, work / f"share-{result.share}" / "server"))
            runs.append((result, Client(server.url)))
        request_no = 0
        for trial in range(trials):
            turns = [workload.turns(s, trial) for s in range(workload.sessions)]
            conversations: list[list[int]] = [[] for _ in range(workload.sessions)]
            ids = {id(client): [client.post({"requestType": "NEW_SESSION"})[1]["x-amzn-sagemaker-session-id"]
                                .split(";")[0] for _ in range(workload.sessions)] for _, client in runs}
            for round_no in range(workload.rounds):
                for s in range(workload.sessions):
                    user, answer = turns[s][round_no]
                    conversations[s] += user
                    order = runs if request_no % 2 == 0 else runs[::-1]
                    request_no += 1
                    for result, client in order:
                        time.sleep(pause_s)  # the other server's threads spin for a while after a step
                        elapsed, _, reply = client.post({"prompt": conversations[s], "max_tokens": 1, "temperature": 0},
                                                        {SESSION_HEADER: ids[id(client)][s]})
                        details = (reply.get("usage") or {}).get("prompt_tokens_details") or {}
                        result.ttft_s[round_no].append(elapsed)
                        result.cached_tokens[round_no].append(int(details.get("cached_tokens") or 0))
                    conversations[s] += answer
            for _, client in runs:
                for session_id in ids[id(client)]:
                    client.post({"requestType": "CLOSE"}, {SESSION_HEADER: session_id})
    return off, on


def report(workload: Workload, off: RunResult, on: RunResult, cpu_gib: float, bpt: int, model: str) -> None:
    total_mib = workload.sessions * workload.last_prompt_tokens * bpt / 2**20
    print(f"## Session retention: {workload.sessions} sessions x {workload.rounds} rounds, tiny {model} model, "
          f"CPU tier {cpu_gib * 1024:.0f} MiB vs {total_mib:.0f} MiB of conversation KV in the last round\n")
    print(f"Each round adds {workload.user_turn_tokens} user + {workload.answer_tokens} answer tokens "
          f"(first turn {workload.first_turn_tokens}); prompt in the last round {workload.last_prompt_tokens} tokens.\n")
    print(f"Retention on: share {on.share}. TTFT: wall clock to the one generated token (max_tokens=1), median "
          f"over the {len(off.ttft_s[0])} requests of the round; on/off: median of the per-request ratios (each "
          f"request went to both servers back to back).\n")
    print("Uncached on/off: prompt tokens left to prefill with retention over those without (what TTFT follows "
          "when the machine is quiet).\n")
    print("| round | prompt tokens | cached tokens off | cached tokens on | uncached on/off | TTFT p50 off | "
          "TTFT p50 on | TTFT on/off |")
    print("|---|---|---|---|---|---|---|---|")
    prompt = workload.first_turn_tokens
    for r in range(workload.rounds):
        cached_off, cached_on = statistics.mean(off.cached_tokens[r]), statistics.mean(on.cached_tokens[r])
        print(f"| {r + 1} | {prompt} | {cached_off:.0f} | {cached_on:.0f} | "
              f"{(prompt - cached_on) / (prompt - cached_off):.2f}x | {_ms(off.ttft_s[r])} | {_ms(on.ttft_s[r])} | "
              f"{_pair_ratio(off.ttft_s[r], on.ttft_s[r])} |")
        prompt += workload.user_turn_tokens + workload.answer_tokens
    # Rounds where plain LRU had lost every session's chunks: what retention is for.
    pressure = [r for r in range(1, workload.rounds) if not any(off.cached_tokens[r])]
    for name, rounds in (("rounds 2-%d" % workload.rounds, list(range(1, workload.rounds))),
                         ("rounds where LRU hit nothing (%s)" % ",".join(str(r + 1) for r in pressure), pressure)):
        if not rounds:
            continue
        off_t, on_t = _flat([off.ttft_s[r] for r in rounds]), _flat([on.ttft_s[r] for r in rounds])
        off_c = sum(sum(off.cached_tokens[r]) for r in rounds)
        on_c = sum(sum(on.cached_tokens[r]) for r in rounds)
        print(f"\n{name[0].upper()}{name[1:]}: cached prompt tokens {off_c:,} off, {on_c:,} on; TTFT on/off "
              f"{_pair_ratio(off_t, on_t)} (median of {len(off_t)} pairs), "
              f"{statistics.mean(on_t) / statistics.mean(off_t):.2f}x (ratio of means)")


def _flat(rows: list[list[float]]) -> list[float]:
    return [value for row in rows for value in row]


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.0f} ms"


def _pair_ratio(off: list[float], on: list[float]) -> str:
    return f"{statistics.median(b / a for a, b in zip(off, on) if a > 0):.2f}x"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--first-turn-tokens", type=int, default=512)
    parser.add_argument("--user-turn-tokens", type=int, default=256)
    parser.add_argument("--answer-tokens", type=int, default=128)
    parser.add_argument("--tier-fraction", type=float, default=0.6,
                        help="CPU tier size as a fraction of all sessions' KV in the last round")
    parser.add_argument("--share", type=float, default=0.5, help="session_retention_share of the 'on' run")
    parser.add_argument("--model", choices=["7m", "32m"], default="32m")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trials", type=int, default=1, help="new sets of sessions on the same servers (more pairs)")
    parser.add_argument("--pause-s", type=float, default=0.3,
                        help="idle time before each request (vLLM's CPU threads spin for a while after each step)")
    args = parser.parse_args()
    if min(args.sessions, args.rounds, args.trials) < 1 or args.tier_fraction <= 0 or not 0 < args.share <= 1:
        parser.error("--sessions, --rounds and --trials must be >= 1, --tier-fraction > 0, 0 < --share <= 1")
    workload = Workload(args.sessions, args.rounds, args.first_turn_tokens, args.user_turn_tokens,
                        args.answer_tokens, args.seed)
    from lmi_cache.devtools.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-sessions-") as tmp:
        work = Path(tmp)
        model_dir = make_tiny_model(work / f"tiny-{args.model}", args.model, seed=0)
        bpt = kv_bytes_per_token(model_dir)
        total_bytes = workload.sessions * workload.last_prompt_tokens * bpt
        cpu_gib = round(args.tier_fraction * total_bytes / 2**30, 4)
        off, on = run_side_by_side(model_dir, work, workload, cpu_gib, args.share, args.trials, args.pause_s)
    report(workload, off, on, cpu_gib, bpt, args.model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
