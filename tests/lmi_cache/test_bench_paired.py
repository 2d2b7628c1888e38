"""Paired A/B no-reuse throughput against two fake servers of known speeds."""
from __future__ import annotations

import asyncio

from lmi_cache.bench.fake_server import FakeOpenAiServer, FakeServerState
from lmi_cache.bench.paired import paired_no_reuse
from lmi_cache.bench.workloads import LongDocQaSpec


def test_paired_ratio_reflects_the_slower_server() -> None:
    spec = LongDocQaSpec(num_documents=4, document_tokens=2000, query_tokens=4, output_tokens=2, seed=3)
    fast = FakeServerState(prefill_s_per_token=0.00005, decode_s_per_token=0.0)
    slow = FakeServerState(prefill_s_per_token=0.0001, decode_s_per_token=0.0)
    with FakeOpenAiServer(fast) as a, FakeOpenAiServer(slow) as b:
        result = asyncio.run(paired_no_reuse(a.url, b.url, "fake-model", spec, pause_s=0.0))
    assert result.num_requests == 4
    # B prefills at half A's speed: its throughput is about half.
    assert 0.35 < result.ratio < 0.65
    assert 0.35 < result.median_pair_ratio < 0.65
    # Every document went to both servers once (plus one unmeasured primer each).
    assert len(fast.prompts) == len(slow.prompts) == 5
    assert fast.prompts[1:] == slow.prompts[1:]
    assert len(set(fast.prompts[1:])) == 4


def test_runs_on_several_server_starts_merge_by_their_sums() -> None:
    from lmi_cache.bench.paired import PairedThroughput

    one = PairedThroughput(a_tokens=1000, a_seconds=1.0, b_tokens=1000, b_seconds=2.0, pair_ratios=(0.5, 0.5))
    two = PairedThroughput(a_tokens=3000, a_seconds=1.0, b_tokens=3000, b_seconds=1.0, pair_ratios=(1.0, 1.0, 1.0))
    both = PairedThroughput.merged([one, two])
    assert both.start_ratios == (0.5, 1.0)
    assert both.num_requests == 5 and both.median_pair_ratio == 1.0
    assert both.ratio == (4000 / 3.0) / (4000 / 2.0)  # tokens over time, not a mean of the two ratios
    assert both.to_dict()["start_ratios"] == [0.5, 1.0]


def test_scrape_total_sums_a_counter_over_its_labels() -> None:
    import http.server
    import threading

    from lmi_cache.bench.paired import scrape_total

    body = (b"# TYPE lmi_cache_worker_save_seconds counter\n"
            b'lmi_cache_worker_save_seconds_total{engine="0",rank="0"} 1.5\n'
            b'lmi_cache_worker_save_seconds_total{engine="0",rank="1"} 0.25\n'
            b'lmi_cache_worker_save_seconds_created{engine="0",rank="0"} 1.7e9\n')

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert scrape_total(url, "lmi_cache_worker_save_seconds") == 1.75
        assert scrape_total(url, "lmi_cache_worker_load_seconds") == 0.0
    finally:
        server.shutdown()
