"""Routing on KV events vs round robin: two servers, repeated long documents, TTFT and hit rate side by side.

Runs as a script: ``python benchmarks/bench_routing.py [--docs 8] [--doc-tokens 2048] [--asks 4] [--model 7m]``.

Two vLLM servers with the connector (CPU tier only, vLLM's own prefix cache
off) publish their KV events (``--kv-events-config``) to this script, which
binds one ZMQ socket per server as a router does. The workload: ``--docs``
documents of ``--doc-tokens`` tokens, each asked about ``--asks`` times (the
document, then a short question), in a seeded random order, one request in
flight (``max_tokens=1``: the reply time is the time to the first token). Each
server's CPU tier holds about ``--tier-docs`` documents, fewer than all of them
and more than half: round robin sends every document to both servers, so each
tier cycles through more than it holds; the event router sends a request to
the server whose CPU tier holds the longest prefix of it (its own reading of
the events: the blocks' token ids chained from their parents, as llm-d
indexes them), and a request no server holds to the server with fewer
documents placed so far.

Both policies run on the same two servers, one after the other, each with its
own documents (same sizes, other seeds), so neither is served from the
other's cache. Prints, per policy, the share of prompt tokens served from a
cache (vLLM's ``cached_tokens``), the median and p90 reply time, and the ratio
of the medians.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CHUNK_TOKENS = 256
BLOCK_TOKENS = 128  # vLLM CPU's block size
QUESTION_TOKENS = 24


class EventRouter:
    """What each server's CPU tier holds, from its KV events: chained block keys computed from token ids."""

    def __init__(self, endpoints: list[str]) -> None:
        import zmq

        self._sockets = []
        for endpoint in endpoints:
            socket = zmq.Context.instance().socket(zmq.SUB)
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            socket.setsockopt(zmq.RCVTIMEO, 100)
            socket.bind(endpoint)
            self._sockets.append(socket)
        self.held: list[set[bytes]] = [set() for _ in endpoints]  # block keys in a server's CPU tier
        self._keys: list[dict[Any, bytes]] = [{} for _ in endpoints]  # engine block hash -> block key
        self.placed = [0] * len(endpoints)
        self._lock = threading.Lock()
        self._running = True
        self._threads = [threading.Thread(target=self._listen, args=(i,), daemon=True) for i in range(len(endpoints))]
        for thread in self._threads:
            thread.start()

    @staticmethod
    def block_key(parent: bytes, tokens: list[int]) -> bytes:
        return hashlib.blake2b(parent + json.dumps(tokens).encode(), digest_size=16).digest()

    def _listen(self, server: int) -> None:
        import msgspec
        import zmq

        while self._running:
            try:
                parts = self._sockets[server].recv_multipart()
            except zmq.Again:
                continue
            for raw in msgspec.msgpack.decode(parts[-1])[1]:
                event = raw if isinstance(raw, dict) else {"type": raw[0]}  # vLLM 0.32 sends tagged maps
                with self._lock:
                    self._apply(server, event)

    def _apply(self, server: int, event: dict[str, Any]) -> None:
        if event.get("medium") != "CPU":
            return
        keys = self._keys[server]
        if event["type"] == "BlockStored":
            parent = event.get("parent_block_hash")
            key = keys.get(parent, b"") if parent is not None else b""
            if parent is not None and parent not in keys:
                return  # an unknown parent: not chainable
            tokens, size = event["token_ids"], event["block_size"]
            for i, engine_hash in enumerate(event["block_hashes"]):
                key = self.block_key(key, tokens[i * size : (i + 1) * size])
                keys[engine_hash] = key
                self.held[server].add(key)
        elif event["type"] == "BlockRemoved":
            for engine_hash in event["block_hashes"]:
                self.held[server].discard(keys.get(engine_hash, b""))

    def choose(self, tokens: list[int]) -> int:
        """The server holding the longest prefix of ``tokens``; else the one with fewer documents placed."""
        with self._lock:
            scores = []
            for held in self.held:
                key, depth = b"", 0
                for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
                    key = self.block_key(key, tokens[start : start + BLOCK_TOKENS])
                    if key not in held:
                        break
                    depth += 1
                scores.append(depth)
        if max(scores) > 0:
            return scores.index(max(scores))
        server = self.placed.index(min(self.placed))
        self.placed[server] += 1
        return server

    def close(self) -> None:
        self._running = False
        for thread in self._threads:
            thread.join(timeout=2)
        for socket in self._sockets:
            socket.close(linger=0)


def complete(url: str, tokens: list[int]) -> tuple[float, int, int]:
    """(reply seconds, prompt tokens, cached prompt tokens) of one request with one new token."""
    body = json.dumps({"model": "tiny", "prompt": tokens, "max_tokens": 1, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=300) as reply:
        usage = json.load(reply)["usage"]
    elapsed = time.perf_counter() - started
    return elapsed, int(usage["prompt_tokens"]), int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def workload(seed: int, docs: int, doc_tokens: int, asks: int) -> list[list[int]]:
    rng = random.Random(seed)
    documents = [[rng.randrange(16, 4096) for _ in range(doc_tokens)] for _ in range(docs)]
    requests = [doc + [rng.randrange(16, 4096) for _ in range(QUESTION_TOKENS)] for doc in documents for _ in range(asks)]
    rng.shuffle(requests)
    return requests


def run_policy(name: str, urls: list[str], requests: list[list[int]], router: EventRouter | None) -> dict[str, Any]:
    times, prompt_tokens, cached_tokens = [], 0, 0
    for i, tokens in enumerate(requests):
        server = router.choose(tokens) if router is not None else i % len(urls)
        elapsed, prompt, cached = complete(urls[server], tokens)
        times.append(elapsed)
        prompt_tokens += prompt
        cached_tokens += cached
        time.sleep(0.3)  # the step that confirms the last stores (and publishes them) runs before the next request
    times.sort()
    return {"policy": name, "requests": len(times), "hit_share": cached_tokens / prompt_tokens,
            "median_s": statistics.median(times), "p90_s": times[int(0.9 * (len(times) - 1))]}


def kv_bytes_per_token(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4  # K and V, float32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--doc-tokens", type=int, default=2048)
    parser.add_argument("--asks", type=int, default=4, help="requests per document")
    parser.add_argument("--tier-docs", type=float, default=5.0, help="documents each server's CPU tier holds")
    parser.add_argument("--model", default="7m", help="tiny model size (lmi_cache.devtools.tiny_model)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-routing-"))
    try:
        run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> None:
    from lmi_cache.bench.vllm_server import OUR_CONNECTOR, ServerSpec, VllmServer, free_port
    from lmi_cache.devtools.tiny_model import make_tiny_model

    model_dir = make_tiny_model(work / f"tiny-{args.model}", args.model, seed=0)
    tier_gib = args.tier_docs * args.doc_tokens * kv_bytes_per_token(model_dir) * 1.05 / 1024**3
    config = work / "lmi-cache.yaml"
    config.write_text(json.dumps({"chunk_size": CHUNK_TOKENS, "local_cpu": True, "max_local_cpu_size": tier_gib,
                                  "max_local_disk_size": 0}))
    ports = [free_port(), free_port()]
    router = EventRouter([f"tcp://127.0.0.1:{port}" for port in ports])
    with contextlib.ExitStack() as stack:
        stack.callback(router.close)
        servers = []
        for i, port in enumerate(ports):
            events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}"}
            spec = ServerSpec(model_dir, max_model_len=args.doc_tokens + 256, kv_transfer_config=OUR_CONNECTOR,
                              lmcache_config_file=config, kvcache_space_gib=1,
                              extra_args=["--kv-events-config", json.dumps(events), "--enable-prompt-tokens-details"])
            servers.append(stack.enter_context(VllmServer(spec, work / f"server-{i}")))
        urls = [server.url for server in servers]
        results = [
            run_policy("round robin", urls, workload(args.seed + 1, args.docs, args.doc_tokens, args.asks), None),
            run_policy("KV events", urls, workload(args.seed + 2, args.docs, args.doc_tokens, args.asks), router),
        ]
    print(f"two servers, model {args.model}, {args.docs} documents x {args.doc_tokens} tokens, {args.asks} asks each, "
          f"CPU tier {tier_gib * 1024:.1f} MiB per server (~{args.tier_docs:g} documents)")
    print("| policy | requests | prompt tokens from a cache | median reply (s) | p90 reply (s) |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['policy']} | {r['requests']} | {r['hit_share']:.0%} | {r['median_s']:.3f} | {r['p90_s']:.3f} |")
    print(f"median reply, round robin / KV events: {results[0]['median_s'] / results[1]['median_s']:.2f}x")


if __name__ == "__main__":
    main()
