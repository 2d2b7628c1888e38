"""Connector benchmark on vLLM CPU: no cache vs vLLM prefix cache vs our tiers vs LMCache.

Runs as a script (``python benchmarks/bench_connector.py [--quick]``): it makes
the tiny random models, starts one vLLM OpenAI server per configuration (one
at a time, 2 cores here), drives it with the ``lmi-cache bench`` long-document
QA workload at concurrency 1 (so TTFT is prefill time, not queueing), and
prints a markdown table. Configurations:

1. no-cache:     prefix caching off, no connector
2. vllm-prefix:  vLLM's own prefix cache
3. ours-cpu:     our connector, CPU tier (prefix caching off: every hit is ours)
4. ours-disk:    warm-up in one server, query in a fresh one (CPU tier empty), then
                 the same documents again in that process (CPU-tier hits: a paired baseline)
5. lmcache:      LMCache 0.5.6's connector from a separate venv (degraded on CPU)
6. no-reuse throughput: unique documents with and without our connector
7. ours-redis:   warm-up in one server, query in a fresh one with an empty CPU tier
                 and no disk tier: every hit comes from a shared redis-server (loopback);
                 then the same documents again (CPU-tier hits: a paired baseline)
8. no-reuse-redis: unique documents, our connector with the Redis tier on vs off
9. no-reuse-control: the no-reuse run with no connector on either side: how far two
                 starts of the same server differ here (the noise floor of rows 6 and 8)
10. ours-cpu-paired: one server with vLLM's prefix cache and our connector: each document's
                 question from vLLM's prefix cache, then (that cache emptied) from our CPU tier,
                 then from vLLM's again: the CPU-tier row paired with vLLM's hit
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from lmi_cache.bench.client import OpenAiClient
from lmi_cache.bench.report import fmt_ratio, fmt_seconds, markdown_table
from lmi_cache.bench.runner import BenchResult, RequestRecord, run_long_doc_qa
from lmi_cache.bench.paired import PairedThroughput, paired_no_reuse, scrape_total
from lmi_cache.bench.stats import percentile
from lmi_cache.bench.workloads import LongDocQaSpec
from lmi_cache.bench.tokens import ServerTokenCounter
from lmi_cache.bench.vllm_server import LMCACHE_CONNECTOR, OUR_CONNECTOR, ServerSpec, VllmServer

CONFIGS = ("no-cache", "vllm-prefix", "ours-cpu", "ours-cpu-paired", "ours-disk", "lmcache", "no-reuse", "ours-redis", "no-reuse-redis",
           "no-reuse-control")
# The paired no-reuse configurations, each a row of the throughput table: (config, label after the model).
THROUGHPUT_ROWS = (("no-reuse", ""), ("no-reuse-redis", ", Redis tier on vs off"),
                   ("no-reuse-control", ", control: no connector on either side"))
UNIQUE_SEED_OFFSET = 1000  # documents of the no-reuse rounds share nothing with the QA ones


def connector_yaml(path: Path, disk_dir: Path | None, remote_url: str | None = None) -> Path:
    lines = ["chunk_size: 256", "local_cpu: true", "max_local_cpu_size: 2"]
    if disk_dir is not None:
        lines += [f"local_disk: file://{disk_dir}", "max_local_disk_size: 4"]
    if remote_url is not None:
        lines += [f"remote_url: {remote_url}", "extra_config: {remote_key_prefix: %s}" % path.stem]
    path.write_text("\n".join(lines) + "\n")
    return path


async def prime(url: str) -> None:
    """One short unmeasured request: a fresh server's first request pays lazy set-up."""
    async with OpenAiClient(url, "tiny") as client:
        await client.complete("hello there", 2)


async def drive(url: str, args: argparse.Namespace, rounds: tuple[str, ...], seed: int,
                before_round: Callable[[str], None] | None = None) -> BenchResult:
    spec = LongDocQaSpec(args.num_documents, args.document_tokens, args.query_tokens, args.output_tokens, seed)
    async with OpenAiClient(url, "tiny", timeout_s=600, extra_body={"ignore_eos": True}) as client:
        return await run_long_doc_qa(client, spec, ServerTokenCounter(client), 1, round_names=rounds,
                                     before_round=before_round)


def run_rounds(spec: ServerSpec, run_dir: Path, args: argparse.Namespace, rounds: tuple[str, ...],
               long_prime: bool = False, before: dict[str, Callable[[str], None]] | None = None) -> dict:
    """Start a server, run ``rounds``, stop it: ``warmup`` and the list of ``query`` rounds.

    ``long_prime``: before measuring, serve one unrelated document of the same length (nothing
    it computes is reused), so a fresh process has paid vLLM's first-long-prompt costs, as the
    process of the CPU-tier row has; the query round then measures the tier, not the process.
    ``before``: an action on the server's URL to run before the round of that name.
    """
    started = time.monotonic()
    out: dict = {"load_s": {}}
    ours = spec.kv_transfer_config == OUR_CONNECTOR
    if ours:  # our series on /metrics: the model thread's load seconds, round by round
        (run_dir / "prometheus").mkdir(parents=True, exist_ok=True)
        spec = replace(spec, extra_env={**spec.extra_env, "PROMETHEUS_MULTIPROC_DIR": str(run_dir / "prometheus")})
    with VllmServer(spec, run_dir) as server:
        out["start_s"] = time.monotonic() - started
        asyncio.run(prime(server.url))
        if long_prime:
            unrelated = argparse.Namespace(**{**vars(args), "num_documents": 1})
            asyncio.run(drive(server.url, unrelated, ("warmup",), args.seed + UNIQUE_SEED_OFFSET + 1))
            time.sleep(args.settle_s)  # its asynchronous stores land before the measured rounds start
        marks: list[float | None] = []  # the model thread's load seconds so far, before each round

        def before_round(name: str) -> None:
            if before and name in before:
                before[name](server.url)
            marks.append(load_seconds(server.url) if ours else None)

        qa = asyncio.run(drive(server.url, args, rounds, args.seed, before_round))
        marks.append(load_seconds(server.url) if ours else None)
        for name, start, end in zip(rounds, marks, marks[1:]):
            if start is not None and end is not None:
                out["load_s"][name] = end - start
        for item in qa.rounds:
            if item.stats.name.startswith("query"):
                out.setdefault("query", []).append(item)
            else:
                out[item.stats.name] = item
        # Give an asynchronous store time to land before the server goes away.
        time.sleep(args.settle_s)
    return out


def reset_prefix_cache(url: str) -> None:
    """Empty vLLM's own prefix cache (a dev-mode endpoint: VLLM_SERVER_DEV_MODE=1)."""
    request = urllib.request.Request(f"{url.rstrip('/')}/reset_prefix_cache", method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()


def load_seconds(url: str) -> float | None:
    """The model thread's seconds in the connector's loads so far (None when /metrics can't say)."""
    try:
        return scrape_total(url, "lmi_cache_worker_load_seconds")
    except (OSError, ValueError):
        return None


def run_config(name: str, model_dir: Path, work: Path, args: argparse.Namespace) -> dict:
    queries = ("query",) + tuple(f"query{i}" for i in range(2, args.query_rounds + 1))
    both = ("warmup",) + queries
    run_dir = work / name
    work.mkdir(parents=True, exist_ok=True)
    base = dict(model_dir=model_dir, max_model_len=args.document_tokens + 1024, kvcache_space_gib=args.kvcache_gib)
    if name == "no-cache":
        return run_rounds(ServerSpec(**base), run_dir, args, both)
    if name == "vllm-prefix":
        return run_rounds(ServerSpec(**base, prefix_caching=True), run_dir, args, both)
    if name == "ours-cpu":
        yaml = connector_yaml(work / "ours-cpu.yaml", None)
        spec = ServerSpec(**base, kv_transfer_config=OUR_CONNECTOR, lmcache_config_file=yaml)
        return run_rounds(spec, run_dir, args, both)
    if name == "ours-cpu-paired":
        # One server with vLLM's prefix cache and our connector: each document's question is served by
        # vLLM's prefix cache ("query"), then, with that cache emptied, by our CPU tier ("rerun"), then by
        # vLLM's prefix cache again ("query2", the blocks the rerun loaded): both hits at the same moment.
        yaml = connector_yaml(work / "ours-cpu-paired.yaml", None)
        spec = ServerSpec(**base, prefix_caching=True, kv_transfer_config=OUR_CONNECTOR, lmcache_config_file=yaml,
                          extra_env={"VLLM_SERVER_DEV_MODE": "1"})
        out = run_rounds(spec, run_dir, args, ("warmup", "query", "rerun", "query2"),
                         before={"rerun": reset_prefix_cache})
        return {**out, "note": "vLLM prefix hits (query rounds) and our CPU-tier hits (rerun) in one server"}
    if name == "ours-disk":
        disk = work / "ours-disk-store"
        yaml = connector_yaml(work / "ours-disk.yaml", disk)
        spec = ServerSpec(**base, kv_transfer_config=OUR_CONNECTOR, lmcache_config_file=yaml)
        first = run_rounds(spec, run_dir / "warmup-process", args, ("warmup",))
        # A fresh process: its CPU tier starts empty, so query hits come from disk; the rerun
        # round then hits the CPU tier the disk hits were promoted into (the paired baseline).
        second = run_rounds(spec, run_dir / "query-process", args, ("query", "rerun"), long_prime=True)
        note = "query in a fresh server process"
        return {"warmup": first["warmup"], "query": second["query"], "rerun": second["rerun"],
                "start_s": second["start_s"], "load_s": second["load_s"], "note": note}
    if name == "ours-redis":
        yaml = connector_yaml(work / "ours-redis.yaml", None, args.redis_url)
        # What `lmi-cache serve` sets with a remote tier (the plan's env): malloc keeps freed memory.
        malloc = {"MALLOC_MMAP_THRESHOLD_": str(64 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}
        spec = ServerSpec(**base, kv_transfer_config=OUR_CONNECTOR, lmcache_config_file=yaml, extra_env=malloc)
        first = run_rounds(spec, run_dir / "warmup-process", args, ("warmup",))
        # A fresh process without a disk tier: its CPU tier starts empty, so query hits come from Redis
        # (then the rerun round's from the CPU tier they were promoted into).
        second = run_rounds(spec, run_dir / "query-process", args, ("query", "rerun"), long_prime=True)
        return {"warmup": first["warmup"], "query": second["query"], "rerun": second["rerun"],
                "start_s": second["start_s"], "load_s": second["load_s"],
                "note": "query in a fresh server process, hits from Redis"}
    if name == "lmcache":
        python = Path(args.lmcache_venv) / "bin" / "python"
        if not python.exists():
            raise RuntimeError(f"no LMCache venv at {args.lmcache_venv}")
        yaml = connector_yaml(work / "lmcache.yaml", None)
        spec = ServerSpec(**base, python=str(python), kv_transfer_config=LMCACHE_CONNECTOR, lmcache_config_file=yaml)
        # One query round: every LMCache request waits out its lookup timeout.
        outcome = run_rounds(spec, run_dir, args, ("warmup", "query"))
        log = (run_dir / "server.log").read_text(errors="replace")
        if "degraded mode" in log:
            outcome["note"] = "LMCache logged 'degraded mode' (no CPU connector)"
        return outcome
    if name in ("no-reuse", "no-reuse-redis", "no-reuse-control"):
        # Both servers up at once, requests alternating: see lmi_cache.bench.paired.
        yaml = connector_yaml(work / "no-reuse.yaml", None)
        ours = ServerSpec(**base, kv_transfer_config=OUR_CONNECTOR, lmcache_config_file=yaml)
        if name == "no-reuse-control":  # the same server twice
            ours = ServerSpec(**base)
        if name == "no-reuse-redis":  # a: our connector without the remote tier, b: with it
            base = dict(base, kv_transfer_config=OUR_CONNECTOR, lmcache_config_file=yaml)
            ours = ServerSpec(**dict(base, lmcache_config_file=connector_yaml(
                work / "no-reuse-redis.yaml", None, args.redis_url)))
        # Twice the documents: more pairs, as the ratio is a small difference between noisy numbers.
        qa_spec = LongDocQaSpec(2 * args.num_documents, args.document_tokens, args.query_tokens,
                                args.output_tokens, args.seed + UNIQUE_SEED_OFFSET)
        # And several server starts: two starts of the same server differ by more than the connector costs.
        runs, save_s = [], 0.0
        for start in range(args.no_reuse_starts):
            # Short names: vLLM's IPC socket paths under them must fit in 107 bytes.
            folders = [run_dir / f"s{start}" / side for side in ("a", "b")]
            for folder in folders:  # where each server's processes put their metrics (vLLM's and ours)
                (folder / "prometheus").mkdir(parents=True, exist_ok=True)
            spec_a, spec_b = (replace(spec, extra_env={**spec.extra_env, "PROMETHEUS_MULTIPROC_DIR": str(folder / "prometheus")})
                              for spec, folder in zip((ServerSpec(**base), ours), folders))
            with VllmServer(spec_a, folders[0]) as a, VllmServer(spec_b, folders[1]) as b:
                runs.append(asyncio.run(paired_no_reuse(a.url, b.url, "tiny", qa_spec,
                                                        extra_body={"ignore_eos": True})))
                try:  # the connector's own seconds on the model thread, to set against the requests' time
                    save_s += scrape_total(b.url, "lmi_cache_worker_save_seconds")
                except (OSError, ValueError) as err:
                    print(f"  could not read the save seconds from /metrics: {err}", file=sys.stderr)
        paired = PairedThroughput.merged(runs)
        return {"paired": paired, "save_share": save_s / paired.b_seconds}
    raise ValueError(name)


def query_records(outcome: dict) -> list[RequestRecord]:
    return [record for item in outcome.get("query", []) for record in item.records]


def median_ttft(records: list[RequestRecord]) -> float | None:
    # Medians: this machine is shared, and one descheduled request skews a mean.
    return percentile([r.result.ttft_s for r in records], 50) if records else None


def same_tokens(results: dict[str, dict], name: str) -> str:
    reference = {r.request_id: r.result.text for r in query_records(results.get("no-cache", {}))}
    mine = [r for r in query_records(results[name]) if r.request_id in reference]
    if not reference or not mine:
        return "—"
    num_differ = sum(r.result.text != reference[r.request_id] for r in mine)
    return "yes" if num_differ == 0 else f"NO ({num_differ}/{len(mine)} differ)"


def model_table(size: str, results: dict[str, dict]) -> tuple[str, list[str]]:
    """The per-model markdown table, plus the target checks as lines."""

    def query_ttft(name: str) -> float | None:
        outcome = results.get(name, {})
        return None if "error" in outcome else median_ttft(query_records(outcome))

    # Without a cache every request is a cold prefill, warm-up or query alike: pool
    # them all for the reference, so load drift between two rounds weighs less.
    cold = results.get("no-cache", {})
    no_cache = None if "error" in cold or "warmup" not in cold else median_ttft(
        cold["warmup"].records + query_records(cold))
    prefix = query_ttft("vllm-prefix")
    header = ["config", "warm-up TTFT (s)", "query TTFT (s)", "query/warm-up", "speed-up vs no cache (all cold)",
              "TTFT / vLLM prefix-cache TTFT", "same tokens as no cache", "note"]
    rows = []
    for name, outcome in results.items():
        if "paired" in outcome:
            continue  # the no-reuse run has its own table
        if "error" in outcome:
            rows.append([f"{name} ({size})", "failed", "", "", "", "", "", outcome["error"][:120]])
            continue
        warm, query = median_ttft(outcome["warmup"].records), query_ttft(name)
        assert warm is not None and query is not None
        rows.append([
            f"{name} ({size})", fmt_seconds(warm), fmt_seconds(query), fmt_ratio(query / warm),
            fmt_ratio(no_cache / query) if no_cache else "—",
            fmt_ratio(query / prefix) if prefix else "—", same_tokens(results, name), outcome.get("note", ""),
        ])
    checks = []
    ours = query_ttft("ours-cpu")
    if ours and no_cache:
        checks.append(f"{size}: ours-cpu query TTFT {no_cache / ours:.1f}x lower than no cache (target >= 10x on 32m)")
    if ours and prefix:
        checks.append(f"{size}: ours-cpu / vLLM prefix hit TTFT {ours / prefix:.2f}x (target <= 1.0x)")
    redis = query_ttft("ours-redis")
    if redis and ours:
        checks.append(f"{size}: ours-redis / ours-cpu query TTFT {redis / ours:.2f}x (target <= 2x on 32m)")
    paired_cpu = paired_against_vllm(results.get("ours-cpu-paired", {}))
    if paired_cpu is not None:
        checks.append(f"{size}: CPU-tier hit / vLLM prefix hit of the same documents in one server: median "
                      f"per-document ratio {paired_cpu[0]:.2f}x, {paired_cpu[1]} documents, median TTFT "
                      f"{paired_cpu[2]:.3f} s vs {paired_cpu[3]:.3f} s (target <= 1.0x)"
                      f"{load_time_note(results['ours-cpu-paired'], paired_cpu[1], ('rerun', 'query'))}")
    for name, tier, target in (("ours-disk", "disk", 1.3), ("ours-redis", "Redis", 2.0)):
        paired = paired_rerun(results.get(name, {}))
        if paired is not None:
            checks.append(f"{size}: {tier} hit in a fresh process / CPU-tier hit of the same documents in that process "
                          f"right after: median per-document ratio {paired[0]:.2f}x, {paired[1]} documents, "
                          f"median TTFT {paired[2]:.3f} s vs {paired[3]:.3f} s (target <= {target:g}x)"
                          f"{load_time_note(results[name], paired[1])}")
    return markdown_table(header, rows), checks


def load_time_note(outcome: dict, num_documents: int, rounds: tuple[str, str] = ("query", "rerun")) -> str:
    """Of that TTFT, the model thread's time in the connector's loads, per document (from /metrics)."""
    tier, cpu = (outcome.get("load_s", {}).get(name) for name in rounds)
    if tier is None or cpu is None or num_documents <= 0:
        return ""
    return (f"; of which loading (model thread, mean per document): {1000 * tier / num_documents:.0f} ms vs "
            f"{1000 * cpu / num_documents:.0f} ms")


def paired_against_vllm(outcome: dict) -> tuple[float, int, float, float] | None:
    """(median per-document ratio of our CPU-tier hit to the mean of the two vLLM prefix hits around it,
    documents, median of ours, median of vLLM's) for the ``ours-cpu-paired`` rounds."""
    if "error" in outcome or "rerun" not in outcome:
        return None
    ours = {r.request_id.split("/", 1)[1]: r.result.ttft_s for r in outcome["rerun"].records}
    vllm: dict[str, list[float]] = {}
    for record in query_records(outcome):
        vllm.setdefault(record.request_id.split("/", 1)[1], []).append(record.result.ttft_s)
    docs = sorted(set(ours) & set(vllm))
    if not docs:
        return None
    theirs = {d: sum(vllm[d]) / len(vllm[d]) for d in docs}
    return (percentile([ours[d] / theirs[d] for d in docs], 50), len(docs),
            percentile([ours[d] for d in docs], 50), percentile([theirs[d] for d in docs], 50))


def paired_rerun(outcome: dict) -> tuple[float, int, float, float] | None:
    """(median of per-document tier-hit / CPU-hit TTFT ratios, documents, median tier TTFT, median CPU TTFT).

    Both rounds run in the same process back to back, so a change of load on this shared
    host between two server starts does not enter the ratio.
    """
    if "error" in outcome or "rerun" not in outcome:
        return None
    tier = {r.request_id.split("/", 1)[1]: r.result.ttft_s for r in query_records(outcome)}
    cpu = {r.request_id.split("/", 1)[1]: r.result.ttft_s for r in outcome["rerun"].records}
    docs = sorted(set(tier) & set(cpu))
    if not docs:
        return None
    ratios = [tier[d] / cpu[d] for d in docs]
    return (percentile(ratios, 50), len(docs), percentile([tier[d] for d in docs], 50),
            percentile([cpu[d] for d in docs], 50))


def throughput_row(size: str, outcome: dict) -> list[str] | None:
    paired: PairedThroughput | None = outcome.get("paired")
    if paired is None:
        return None
    share = outcome.get("save_share")
    return [size, str(len(paired.start_ratios)), str(paired.num_requests), f"{paired.a_prompt_tokens_per_s:.0f}",
            f"{paired.b_prompt_tokens_per_s:.0f}", fmt_ratio(paired.ratio),
            ", ".join(fmt_ratio(r) for r in paired.start_ratios), fmt_ratio(paired.median_pair_ratio),
            "—" if share is None else f"{100 * share:.1f}%"]


def summary_of(outcome: dict) -> dict:
    if "error" in outcome:
        return {"error": outcome["error"]}
    if "paired" in outcome:
        return {"no_reuse": outcome["paired"].to_dict(), "save_share": outcome.get("save_share")}
    out = {"warmup": outcome["warmup"].stats.to_dict()}
    out["query"] = [item.stats.to_dict() for item in outcome.get("query", [])]
    out["query_ttft_p50_s"] = median_ttft(query_records(outcome))
    if "rerun" in outcome:
        out["rerun"] = outcome["rerun"].stats.to_dict()
        paired = paired_rerun(outcome)
        out["tier_hit_over_cpu_hit_paired"] = paired[0] if paired else None
    out["note"] = outcome.get("note", "")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI smoke: 7m model, 2k-token documents, no LMCache")
    parser.add_argument("--models", default=None, help="comma list of tiny model sizes (default 7m,32m)")
    parser.add_argument("--configs", default=None, help=f"comma list from {','.join(CONFIGS)}")
    parser.add_argument("--num-documents", type=int, default=None)
    parser.add_argument("--document-tokens", type=int, default=None)
    parser.add_argument("--query-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--query-rounds", type=int, default=None, help="query rounds per server (pooled)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-reuse-starts", type=int, default=None,
                        help="server starts the no-reuse rows pool (each: both servers, every document; "
                             "default 3, 1 with --quick)")
    parser.add_argument("--kvcache-gib", type=int, default=2)
    parser.add_argument("--settle-s", type=float, default=2.0, help="wait before stopping a server")
    parser.add_argument("--lmcache-venv", default=str(Path(__file__).resolve().parents[2] / "lmcache-venv"))
    parser.add_argument("--models-dir", default=str(Path(tempfile.gettempdir()) / "lmi-cache-tiny-models"))
    parser.add_argument("--work-dir", default=None, help="run folders (default: a fresh temp folder, removed after)")
    parser.add_argument("--json", default=None, help="write the headline numbers as JSON here")
    args = parser.parse_args()
    quick_configs = "no-cache,vllm-prefix,ours-cpu,ours-disk,no-reuse"
    sizes = (args.models or ("7m" if args.quick else "7m,32m")).split(",")
    configs = (args.configs or (quick_configs if args.quick else ",".join(CONFIGS))).split(",")
    args.num_documents = args.num_documents or (2 if args.quick else 4)
    args.query_rounds = args.query_rounds or (2 if args.quick else 3)
    args.document_tokens = args.document_tokens or (2048 if args.quick else 8000)
    args.no_reuse_starts = args.no_reuse_starts or (1 if args.quick else 3)

    from lmi_cache.devtools.tiny_model import make_tiny_model

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="lmi-bench-connector-"))
    tables, checks, throughput, summary = [], [], [], {}
    redis = None
    if any(c in ("ours-redis", "no-reuse-redis") for c in configs):
        from lmi_cache.devtools.redis_server import RedisServer

        redis = RedisServer().start()  # its own loopback port, stopped at the end
    args.redis_url = redis.url if redis is not None else None
    try:
        for size in sizes:
            model_dir = make_tiny_model(Path(args.models_dir) / size, size=size, seed=0)
            results: dict[str, dict] = {}
            for name in configs:
                print(f"[{time.strftime('%H:%M:%S')}] {size} {name} ...", file=sys.stderr, flush=True)
                try:
                    results[name] = run_config(name, model_dir, work / size, args)
                except Exception as err:  # one broken configuration must not hide the others
                    results[name] = {"error": " ".join(f"{type(err).__name__}: {err}".split())}
                    print(f"  {name} failed: {results[name]['error'][:300]}", file=sys.stderr, flush=True)
            table, model_checks = model_table(size, results)
            tables.append(f"### {size} model, {args.num_documents} documents x {args.document_tokens} tokens\n\n{table}")
            checks += model_checks
            for config, label in THROUGHPUT_ROWS:
                line = throughput_row(f"{size}{label}", results.get(config, {}))
                if line:
                    throughput.append(line)
            summary[size] = {name: summary_of(r) for name, r in results.items()}
    finally:
        if redis is not None:
            redis.stop()
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print("\n\n".join(tables))
    if throughput:
        print("\nNo-reuse throughput (unique documents sent to both servers in turn, prompt tokens/s):\n")
        header = ["model", "server starts", "requests", "no connector", "our connector", "ratio (target >= 0.99)",
                  "ratio per start", "median pair ratio", "connector's saves, share of request time"]
        print(markdown_table(header, throughput))
    if checks:
        print("\n" + "\n".join(f"- {line}" for line in checks))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
