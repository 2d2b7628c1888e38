"""KV events of the CPU and disk tiers through a real ``lmi-cache serve``, read by llm-d's and Dynamo's rules.

One server for the module, turned on the LMI way: ``option.kv_events_config``
(vLLM's ``--kv-events-config`` JSON) and ``option.lmcache_config_file`` with a
CPU tier of three chunks that demotes to a disk tier. vLLM's own prefix cache
is off, so every event on the stream is the connector's. A subscriber on the
ZMQ stream feeds both consumers (``tests/kv_event_consumers.py``): after a
prompt, both reconstruct that this server holds its blocks in CPU; after two
other prompts push it out of the CPU tier, both see it removed from CPU and
stored on disk, the disk store first; sent again, it is a hit and back in CPU.
Then the server stops and a fresh one starts on the same disk directory: its
first events announce the files it adopted, before any request for them (the
module's second and last vLLM start).
"""
from __future__ import annotations

import json
import random
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.test_serve_e2e import Server, free_port, post, running_serve, serve_env
from tests.kv_event_consumers import DynamoIndex, Event, LlmdIndex, decode_events

pytestmark = [pytest.mark.vllm]

BLOCK = 128  # vLLM CPU's block size
CHUNK = 256
CHUNK_BYTES_GIB = 0.0015  # the 7M model's 256-token chunk is 0.5 MiB: three chunks fit
PROMPT_TOKENS = 2 * CHUNK + 40  # two full chunks (four blocks) and a tail that is never stored
WAIT_S = 120.0


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 4096) for _ in range(PROMPT_TOKENS)]


class Subscriber:
    """Every event on the stream, in order, decoded (tagged maps or positional arrays). It binds and the
    server's publisher connects to it, as llm-d's indexer runs (vLLM connects to an endpoint without a wildcard)."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.setsockopt(zmq.RCVTIMEO, 200)
        self._socket.bind(endpoint)
        self.events: list[Event] = []
        self._lock = threading.Lock()
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while self._running:
            try:
                parts = self._socket.recv_multipart()
            except zmq.Again:
                continue
            with self._lock:
                self.events.extend(decode_events(parts[-1]))

    def snapshot(self) -> list[Event]:
        with self._lock:
            return list(self.events)

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=5)
        self._socket.close(linger=0)


@dataclass
class Served:
    """The module's server and the stream it publishes; ``stop`` ends both (the restart test starts another)."""

    server: Server
    subscriber: Subscriber
    stop: Callable[[], None]


def start(tiny_model: Path, root: Path, disk: Path, stack: ExitStack) -> tuple[Server, Subscriber]:
    """``lmi-cache serve`` under ``root`` with its disk tier in ``disk``, and a subscriber bound before it starts."""
    model_dir = root / "model"
    model_dir.mkdir(parents=True)
    config = {"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": CHUNK_BYTES_GIB,
              "local_disk": f"file://{disk}/", "max_local_disk_size": 0.05,
              "extra_config": {"disk_feed": "demote"}}
    (root / "lmcache.yaml").write_text(json.dumps(config))
    events_port = free_port()
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events_port}"}
    (model_dir / "serving.properties").write_text("\n".join([
        f"option.model_id={tiny_model}",
        "option.dtype=fp32",
        "option.max_model_len=2048",
        "option.max_rolling_batch_size=2",
        "option.enforce_eager=true",
        "option.enable_prefix_caching=false",
        "option.enable_prompt_tokens_details=true",
        f"option.lmcache_config_file={root / 'lmcache.yaml'}",
        f"option.kv_events_config={json.dumps(kv_events)}",
    ]) + "\n")
    port = free_port()
    subscriber = Subscriber(f"tcp://127.0.0.1:{events_port}")
    stack.callback(shutil.rmtree, root / "rpc", ignore_errors=True)
    stack.callback(subscriber.close)
    server = stack.enter_context(running_serve(model_dir, root, serve_env(root, port), port))
    return server, subscriber


@pytest.fixture(scope="module")
def disk(e2e_dir: Path) -> Path:
    path = e2e_dir / "kv-events-disk"
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def served(tiny_model: Path, e2e_dir: Path, disk: Path) -> Iterator[Served]:
    with ExitStack() as stack:
        server, subscriber = start(tiny_model, e2e_dir / "kv-events", disk, stack)
        yield Served(server, subscriber, stack.close)


def complete(server: Server, tokens: list[int]) -> int:
    """Send a prompt (one new token); the prompt tokens that came from a cache."""
    reply = post(f"{server.url}/v1/completions", {"prompt": tokens, "max_tokens": 1,
                                                  "temperature": 0})
    details = reply["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def consumers(events: list[Event]) -> tuple[LlmdIndex, DynamoIndex]:
    model = "tiny"
    llmd, dynamo = LlmdIndex(BLOCK, model), DynamoIndex(BLOCK)
    for event in events:
        llmd.apply(event)
        dynamo.apply(event)
    return llmd, dynamo


def wait_for(server: Server, subscriber: Subscriber, seen: Callable[[LlmdIndex, DynamoIndex], bool]) -> None:
    """Until both consumers see what ``seen`` asks; a short prompt now and then runs a step (a disk write's
    confirmation comes back with the next step, and an idle engine runs none)."""
    deadline = time.monotonic() + WAIT_S
    nudge = 0
    while not seen(*consumers(subscriber.snapshot())):
        if time.monotonic() > deadline:
            llmd, dynamo = consumers(subscriber.snapshot())
            pytest.fail(f"consumers never saw it: {len(subscriber.snapshot())} events, llm-d {llmd.entries}, "
                        f"dynamo {dynamo.trees}\n{server.log_tail()}")
        time.sleep(0.5)
        nudge += 1
        if nudge % 4 == 0:
            complete(server, [17 + nudge % 50] * 8)


FIRST = 4  # the prompt's full blocks


def test_events_route_a_prompt_to_cpu_then_disk_and_back(served: Served) -> None:
    server, subscriber = served.server, served.subscriber
    doc = prompt(1)
    assert complete(server, doc) == 0

    def in_cpu(llmd: LlmdIndex, dynamo: DynamoIndex) -> bool:
        return all("cpu" in tiers for tiers in llmd.tiers_of(doc)[:FIRST]) and dynamo.matched_blocks("host", doc) == FIRST

    wait_for(server, subscriber, in_cpu)

    # What every one of our events says: the engine's block size, vLLM's mediums, local, two blocks per chunk.
    ours = [e for e in subscriber.snapshot() if e.kind == "BlockStored"]
    assert ours and {(e.get("block_size"), e.get("medium"), e.get("locality")) for e in ours} <= {
        (BLOCK, "CPU", "LOCAL"), (BLOCK, "STORAGE", "LOCAL")}
    assert all(len(e.get("block_hashes")) == CHUNK // BLOCK and len(e.get("token_ids")) == CHUNK for e in ours)
    assert all(isinstance(h, int) for e in ours for h in e.get("block_hashes"))

    # Two other prompts of two chunks each: the CPU tier (three chunks) demotes the first prompt's to disk.
    assert complete(server, prompt(2)) == 0
    assert complete(server, prompt(3)) == 0

    def on_disk_not_cpu(llmd: LlmdIndex, dynamo: DynamoIndex) -> bool:
        tiers = llmd.tiers_of(doc)[:FIRST]
        return (all(t == {"storage"} for t in tiers) and dynamo.matched_blocks("host", doc) == 0
                and dynamo.matched_blocks("device", doc) == FIRST)  # Dynamo files vLLM's STORAGE in its default tier

    wait_for(server, subscriber, on_disk_not_cpu)
    events = subscriber.snapshot()
    doc_hashes = set()
    for event in events:
        if event.kind == "BlockStored" and event.get("medium") == "CPU" and list(event.get("token_ids")) == doc[:CHUNK]:
            doc_hashes.update(event.get("block_hashes"))
    stored_disk = next(i for i, e in enumerate(events) if e.kind == "BlockStored" and e.get("medium") == "STORAGE"
                       and doc_hashes & set(e.get("block_hashes")))
    removed_cpu = next(i for i, e in enumerate(events) if e.kind == "BlockRemoved" and e.get("medium") == "CPU"
                       and doc_hashes & set(e.get("block_hashes")))
    assert stored_disk < removed_cpu  # stored on the new tier before removed from the old

    # Sent again, the prompt is a hit (from disk) and is promoted back into the CPU tier.
    assert complete(server, doc) >= 2 * CHUNK
    wait_for(server, subscriber, in_cpu)
    llmd, dynamo = consumers(subscriber.snapshot())
    assert llmd.dropped == 0 and dynamo.dropped == 0


def test_a_restarted_server_announces_the_disk_files_it_adopts(served: Served, tiny_model: Path, e2e_dir: Path,
                                                                 disk: Path) -> None:
    """Runs after the test above left the first prompt's chunks on disk: a fresh server's first events say so."""
    served.stop()
    doc = prompt(1)
    with ExitStack() as stack:
        server, subscriber = start(tiny_model, e2e_dir / "kv-events-restart", disk, stack)
        assert not [e for e in subscriber.snapshot() if e.kind == "BlockStored"]  # nothing before the first step

        def on_disk(llmd: LlmdIndex, dynamo: DynamoIndex) -> bool:  # before any request for the prompt
            return (all("storage" in tiers for tiers in llmd.tiers_of(doc)[:FIRST])
                    and dynamo.matched_blocks("device", doc) == FIRST)

        wait_for(server, subscriber, on_disk)  # the short prompts it sends run the first steps
        assert complete(server, doc) >= 2 * CHUNK  # and the files are really there
