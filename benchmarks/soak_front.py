"""Soak of the LMI front door through ``lmi-cache serve`` with the KV cache on (vLLM CPU, tiny model).

Runs as a script: ``python benchmarks/soak_front.py [--requests 1000] [--concurrency 16]``.
Mixes every request shape (LMI ``inputs`` JSON / streamed / batched, OpenAI
``prompt``, chat ``messages``), stateful sessions (opened at start, used at
random, closed at the end), the two adapters (header, ``adapters`` field,
OpenAI ``model``) and the base model, over repeated long prompts (cache hits)
and unique ones (misses, stores, evictions). Greedy decoding: every answer to
a repeated (prompt, adapter) must equal the first one. Samples the resident
memory of the server's process tree every second and prints its curve.
Exit status 1 on any error or changed answer.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = ("lmi", "lmi-stream", "lmi-batch", "openai", "chat")
ADAPTERS = (None, "tenant-a", "tenant-b")


def long_prompt(tag: str, words: int = 300) -> str:
    rng = random.Random(tag)
    vocab = ["alpha", "beta", "gamma", "delta", "kv", "cache", "tier", "chunk", "token", "layer"]
    return f"[{tag}] " + " ".join(f"{rng.choice(vocab)}{rng.randrange(100)}" for _ in range(words))


def post(url: str, payload: Any, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=600) as reply:
            return reply.status, {k.lower(): v for k, v in reply.headers.items()}, reply.read()
    except urllib.error.HTTPError as err:
        return err.code, {}, err.read()


def one_request(url: str, rng: random.Random, pool: list[str], sessions: list[str], unique: int
                ) -> tuple[list[tuple[str, str]], str | None]:
    """Send one random request; return ((key, text) answers, error)."""
    shape = rng.choice(SHAPES)
    adapter = rng.choice(ADAPTERS)
    prompt = pool[rng.randrange(len(pool))] if rng.random() < 0.7 else long_prompt(f"unique-{unique}")
    headers: dict[str, str] = {}
    if sessions and rng.random() < 0.4:
        headers["X-Amzn-SageMaker-Session-Id"] = rng.choice(sessions)
    params = {"max_new_tokens": 8, "do_sample": False}
    if shape.startswith("lmi"):
        inputs: Any = [prompt, pool[0]] if shape == "lmi-batch" else prompt
        payload: dict[str, Any] = {"inputs": inputs, "parameters": params, "stream": shape == "lmi-stream"}
        if adapter and rng.random() < 0.5:
            headers["X-Amzn-SageMaker-Adapter-Identifier"] = adapter
        elif adapter:
            payload["adapters"] = adapter
    elif shape == "openai":
        payload = {"prompt": prompt, "max_tokens": 8, "temperature": 0, **({"model": adapter} if adapter else {})}
    else:
        payload = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "temperature": 0,
                   **({"model": adapter} if adapter else {})}
    status, _, body = post(url, payload, headers)
    if status != 200:
        return [], f"{shape} {adapter} -> {status}: {body[:200]!r}"
    if shape == "lmi-stream":
        texts = [json.loads(line)["generated_text"] for line in body.decode().splitlines()
                 if "generated_text" in json.loads(line)]
    elif shape == "lmi-batch":
        texts = [item["generated_text"] for item in json.loads(body)]
    elif shape == "lmi":
        texts = [json.loads(body)["generated_text"]]
    elif shape == "openai":
        texts = [json.loads(body)["choices"][0]["text"]]
    else:
        texts = [json.loads(body)["choices"][0]["message"]["content"]]
    prompts = [prompt, pool[0]] if shape == "lmi-batch" else [prompt]
    kind = "chat" if shape == "chat" else "completion"
    return [(f"{kind}|{adapter}|{p}", f"{shape}\t{t}") for p, t in zip(prompts, texts)], None


def tree_rss_bytes(pid: int) -> int:
    import psutil

    try:
        root = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    except psutil.Error:
        return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--no-cache", action="store_true", help="control run: serve without lmi-cache")
    parser.add_argument("--vllm-prefix-cache", action="store_true",
                        help="control run: vLLM's own prefix cache instead of lmi-cache")
    args = parser.parse_args()
    from lmi_cache.devtools.front_demo import make_front_model_dir
    from lmi_cache.devtools.tiny_model import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="soak-front-"))
    tiny = make_tiny_model(work / "tiny-7m", "7m", seed=0)
    model_dir = make_front_model_dir(work / "model", tiny, work / "sessions",
                                     extra=["option.max_rolling_batch_size=16",
                                            f"option.enable_prefix_caching={str(args.vllm_prefix_cache).lower()}"],
                                     cache=not (args.no_cache or args.vllm_prefix_cache))
    for sub in ("rpc", "vllm-cache", "runtime"):
        (work / sub).mkdir()
    port = 18000 + os.getpid() % 1000
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPTION_", "SM_", "LMCACHE_"))}
    env.update(SAGEMAKER_BIND_TO_PORT=str(port), LMI_CACHE_RUNTIME_DIR=str(work / "runtime"), HF_HUB_OFFLINE="1",
               VLLM_RPC_BASE_PATH=str(work / "rpc"), VLLM_CACHE_ROOT=str(work / "vllm-cache"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    script = Path(sys.executable).with_name("lmi-cache")
    log = open(work / "serve.log", "wb")
    proc = subprocess.Popen([str(script), "serve", "--model-dir", str(model_dir)], stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    samples: list[tuple[float, int]] = []
    stop = threading.Event()
    try:
        while True:
            if proc.poll() is not None:
                print(f"serve exited with {proc.returncode}; see {work / 'serve.log'}")
                return 1
            try:
                with urllib.request.urlopen(url + "/ping", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                time.sleep(1)
        sessions = []
        for _ in range(args.sessions):
            _, headers, _ = post(url + "/invocations", {"requestType": "NEW_SESSION"}, {})
            sessions.append(headers["x-amzn-sagemaker-session-id"].split(";")[0])
        pool = [long_prompt(f"doc-{i}") for i in range(6)]
        started = time.monotonic()

        def sample() -> None:
            while not stop.is_set():
                samples.append((time.monotonic() - started, tree_rss_bytes(proc.pid)))
                stop.wait(1.0)

        threading.Thread(target=sample, daemon=True).start()
        rngs = [random.Random(i) for i in range(args.requests)]
        with ThreadPoolExecutor(args.concurrency) as pool_exec:
            results = list(pool_exec.map(lambda i: one_request(url + "/invocations", rngs[i], pool, sessions, i),
                                         range(args.requests)))
        elapsed = time.monotonic() - started
        stop.set()
        for session in sessions:
            post(url + "/invocations", {"requestType": "CLOSE"}, {"X-Amzn-SageMaker-Session-Id": session})
        errors = [err for _, err in results if err]
        first: dict[str, str] = {}
        changed = 0
        repeats = 0
        by_kind: dict[str, int] = {}
        for answers, _ in results:
            for key, tagged in answers:
                shape, text = tagged.split("\t", 1)
                if key in first:
                    repeats += 1
                    if text != first[key]:
                        changed += 1
                        kind = f"{key.split('|')[0]} adapter={key.split('|')[1]} shape={shape}"
                        by_kind[kind] = by_kind.get(kind, 0) + 1
                else:
                    first[key] = text
        mode = "vLLM prefix cache" if args.vllm_prefix_cache else "no cache" if args.no_cache else "lmi-cache"
        print(f"{mode}: "
              f"{args.requests} requests at concurrency {args.concurrency} in {elapsed:.1f} s: "
              f"{len(errors)} errors, {repeats} repeated answers, {changed} differing from the first")
        for err in errors[:5]:
            print(f"  error: {err}")
        for kind, count in sorted(by_kind.items()):
            print(f"  differing: {count} x {kind}")
        step = max(1, len(samples) // 12)
        curve = ", ".join(f"{t:.0f}s {rss / 2**30:.2f}" for t, rss in samples[::step])
        print(f"resident memory of the server tree (GiB): {curve}")
        return 1 if errors or changed else 0
    finally:
        stop.set()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        if os.environ.get("LMI_CACHE_KEEP_SOAK"):
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
