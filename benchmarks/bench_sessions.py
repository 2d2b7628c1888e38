"""Session retention on a multi-round chat under cache pressure: TTFT per round with and without it, side by side.

Runs as a script: ``python benchmarks/bench_sessions.py [--sessions 12] [--rounds 6] [--model 32m]``.

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
after the other (which goes first alternates), so only one request is ever in
flight and a slow spell of a shared machine hits both alike. Prints per round
the median TTFT of each, the median of the per-request ratios on/off, and the
mean cached prompt tokens of each.
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

    def turns(self, session: int) -> list[tuple[list[int], list[int]]]:
        """Per round: (user turn ids, assistant answer ids) of one session, the same in every run."""
        rng = random.Random(self.seed * 100_003 + session)
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


def run_side_by_side(model_dir: Path, work: Path, workload: Workload, cpu_gib: float,
                     share: float) -> tuple[RunResult, RunResult]:
    """Both servers up at once; each request goes to both, one after the other (order alternating).

    Only one request is in flight at a time, so the two servers never compete for the cores during a
    measurement, and a slow spell of a shared machine hits both runs alike.
    """
    from lmi_cache.bench.vllm_server import VllmServer

    off, on = RunResult(0.0), RunResult(share)
    turns = [workload.turns(s) for s in range(workload.sessions)]
    conversations: list[list[int]] = [[] for _ in range(workload.sessions)]
    with contextlib.ExitStack() as stack:
        runs = []
        for result in (off, on):
            spec = server_spec(model_dir, work / f"share-{result.share}", workload, cpu_gib, result.share)
            server = stack.enter_context(VllmServer(spec, work / f"share-{result.share}" / "server"))
            client = Client(server.url)
            ids = [client.post({"requestType": "NEW_SESSION"})[1]["x-amzn-sagemaker-session-id"].split(";")[0]
                   for _ in range(workload.sessions)]
            runs.append((result, client, ids))
        request_no = 0
        for round_no in range(workload.rounds):
            for result, _, _ in runs:
                result.ttft_s.append([])
                result.cached_tokens.append([])
            for s in range(workload.sessions):
                user, answer = turns[s][round_no]
                conversations[s] += user
                order = runs if request_no % 2 == 0 else runs[::-1]
                request_no += 1
                for result, client, ids in order:
                    elapsed, _, reply = client.post(
                        {"prompt": conversations[s], "max_tokens": 1, "temperature": 0}, {SESSION_HEADER: ids[s]})
                    details = (reply.get("usage") or {}).get("prompt_tokens_details") or {}
                    result.ttft_s[-1].append(elapsed)
                    result.cached_tokens[-1].append(int(details.get("cached_tokens") or 0))
                conversations[s] += answer
        for _, client, ids in runs:
            for session_id in ids:
                client.post({"requestType": "CLOSE"}, {SESSION_HEADER: session_id})
    return off, on


def report(workload: Workload, off: RunResult, on: RunResult, cpu_gib: float, bpt: int, model: str) -> None:
    total_mib = workload.sessions * workload.last_prompt_tokens * bpt / 2**20
    print(f"## Session retention: {workload.sessions} sessions x {workload.rounds} rounds, tiny {model} model, "
          f"CPU tier {cpu_gib * 1024:.0f} MiB vs {total_mib:.0f} MiB of conversation KV in the last round\n")
    print(f"Each round adds {workload.user_turn_tokens} user + {workload.answer_tokens} answer tokens "
          f"(first turn {workload.first_turn_tokens}); prompt in the last round {workload.last_prompt_tokens} tokens.\n")
    print(f"| round | prompt tokens | TTFT p50 off | TTFT p50 on (share {on.share}) | on/off (median of pairs) | "
          f"cached tokens off | cached tokens on |")
    print("|---|---|---|---|---|---|---|")
    prompt = workload.first_turn_tokens
    for r in range(workload.rounds):
        off_s, on_s = statistics.median(off.ttft_s[r]), statistics.median(on.ttft_s[r])
        pairs = statistics.median(b / a for a, b in zip(off.ttft_s[r], on.ttft_s[r]))
        print(f"| {r + 1} | {prompt} | {off_s * 1e3:.1f} ms | {on_s * 1e3:.1f} ms | {pairs:.2f}x | "
              f"{statistics.mean(off.cached_tokens[r]):.0f} | {statistics.mean(on.cached_tokens[r]):.0f} |")
        prompt += workload.user_turn_tokens + workload.answer_tokens
    later_off = [t for row in off.ttft_s[1:] for t in row]
    later_on = [t for row in on.ttft_s[1:] for t in row]
    if later_off:
        mean_off, mean_on = statistics.mean(later_off), statistics.mean(later_on)
        print(f"\nRounds 2-{workload.rounds}: mean TTFT {mean_off * 1e3:.1f} ms off, {mean_on * 1e3:.1f} ms on: "
              f"{mean_on / mean_off:.2f}x; median {statistics.median(later_on) / statistics.median(later_off):.2f}x; "
              f"cached prompt tokens {sum(map(sum, off.cached_tokens[1:]))} off, {sum(map(sum, on.cached_tokens[1:]))} on")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--first-turn-tokens", type=int, default=512)
    parser.add_argument("--user-turn-tokens", type=int, default=256)
    parser.add_argument("--answer-tokens", type=int, default=128)
    parser.add_argument("--tier-fraction", type=float, default=0.4,
                        help="CPU tier size as a fraction of all sessions' KV in the last round")
    parser.add_argument("--share", type=float, default=0.5, help="session_retention_share of the 'on' run")
    parser.add_argument("--model", choices=["7m", "32m"], default="32m")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.sessions < 1 or args.rounds < 1 or args.tier_fraction <= 0 or not 0 < args.share <= 1:
        parser.error("--sessions and --rounds must be >= 1, --tier-fraction > 0, 0 < --share <= 1")
    workload = Workload(args.sessions, args.rounds, args.first_turn_tokens, args.user_turn_tokens,
                        args.answer_tokens, args.seed)
    from lmi_cache.devtools.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-sessions-") as tmp:
        work = Path(tmp)
        model_dir = make_tiny_model(work / f"tiny-{args.model}", args.model, seed=0)
        bpt = kv_bytes_per_token(model_dir)
        total_bytes = workload.sessions * workload.last_prompt_tokens * bpt
        cpu_gib = round(args.tier_fraction * total_bytes / 2**30, 4)
        off, on = run_side_by_side(model_dir, work, workload, cpu_gib, args.share)
    report(workload, off, on, cpu_gib, bpt, args.model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
