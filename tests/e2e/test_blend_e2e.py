"""Blending in LmiCacheConnector on real vLLM (CPU, float32): blends load cached segments, exact cases match no cache.

One vLLM start (a ``run_blend_llm.py`` subprocess; ``enable_blending: true`` in
the LMCache YAML) serves every phase:

- ``seed``: a RAG prompt [D0 D1 D2 D3 | question] is prefilled cold; its four
  segments are stored (each computed alone at position 0).
- ``ref``: the later prompts under another ``cache_salt`` with blending off: the
  no-cache references (their own namespace, so nothing of the seed is reused).
- ``ratio1``: documents in another order, recompute ratio 1.0: blended (segments
  loaded, reported as external hits), same output as no cache.
- ``pos0``: one segment at position 0, ratio 0: the cached KV is the exact KV.
- ``default``: another order at the default ratio; ``explicit``: segment ends given
  in ``kv_transfer_params`` instead of separators.
- ``exact_after_blend``: the ``default`` prompt again with blending off: neither
  vLLM's prefix cache nor the chunk cache may serve it from the blended KV.
- ``seed_blending_on``: the seed prompt again, blending on, vLLM's prefix cache
  emptied: its exact chunks win over blending its segments (answer = no cache).
- ``exact_then_blend``: the seed's documents plus one more: exact chunks up to
  where they reach, the cached segment after them blended (ratio 1.0: = no cache);
  ``exact_after_partial_blend``: that prompt again with blending off reuses only
  the exact part.
"""
from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import pytest
from e2e_support import job_env, job_slot, phase
from warm_start import run_script

RUN_BLEND_LLM = Path(__file__).with_name("run_blend_llm.py")
SEP = [306, 306, 224]  # the tiny tokenizer's ids of LMCache's separator " # # " (checked below)
LOGPROB_ATOL = 2e-3  # float32, our attention vs vLLM's kernel: rounding only


def _tokens(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([t for t in range(10, 4000) if t not in SEP]) for _ in range(length)]


D = [_tokens(10, 180), _tokens(11, 300), _tokens(12, 260), _tokens(13, 340)]
Q = [_tokens(20 + i, 20) for i in range(6)]
CHUNK = 256


def _prompt(docs: list[int], question: int) -> list[int]:
    out: list[int] = []
    for i in docs:
        out += D[i] + SEP
    return out + Q[question]


SEED = _prompt([0, 1, 2, 3], 0)
B = _prompt([0, 2, 1, 3], 1)
P = _prompt([1], 2)
C = _prompt([3, 0, 2], 3)
X_DOCS = D[2] + SEP + D[3] + SEP
X = X_DOCS + Q[4]
X_ENDS = [len(D[2]) + 3, len(X_DOCS)]
E = _prompt([0, 1, 2, 3, 1], 5)  # SEED's documents, then D1 again: its chunks cover SEED's first 4 * CHUNK tokens


def _item(tokens: list[int], salt: str | None = None, **params: Any) -> dict[str, Any]:
    return {"tokens": tokens, "salt": salt, "params": params or None}


def _phase(name: str, items: list[dict[str, Any]], reset_prefix_cache: bool = False) -> dict[str, Any]:
    return {"name": name, "prompts": items, "max_tokens": 8, "logprobs": 2, "reset_prefix_cache": reset_prefix_cache}


def _plugin_path(root: Path) -> Path:
    """A folder whose dist-info declares the plugin's entry point, as installing lmi-cache does."""
    info = root / "lmi_cache_blend_plugin-0.0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lmi-cache-blend-plugin\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nlmi_cache_blend = lmi_cache.vllm_connector.plugin:register\n"
    )
    return root


@pytest.fixture(scope="module")
def blend_run(tiny_model: Path, e2e_dir: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(tiny_model)).encode(" # # ", add_special_tokens=False) == SEP
    work = e2e_dir / "blend"
    work.mkdir(parents=True, exist_ok=True)
    ref = "reference"
    config = work / "lmcache.yaml"
    config.write_text(f"chunk_size: {CHUNK}\nlocal_cpu: true\nmax_local_cpu_size: 1\n"
                      "enable_blending: true\nblend_min_tokens: 64\n")
    job = {
        "model": str(tiny_model),
        "env": {"LMCACHE_CONFIG_FILE": str(config)},
        "phases": [
            _phase("seed", [_item(SEED)]),
            _phase("ref", [_item(t, ref, blend=False) for t in (B, P, C, X, SEED, E)]),
            _phase("ratio1", [_item(B, blend_recompute_ratios=[1.0])]),
            _phase("pos0", [_item(P, blend_recompute_ratios=[0.0])]),
            _phase("default", [_item(C)]),
            _phase("explicit", [_item(X, blend_segment_ends=X_ENDS)]),
            _phase("exact_after_blend", [_item(C, blend=False)]),
            _phase("exact_seed_again", [_item(SEED, blend=False)]),
            _phase("seed_blending_on", [_item(SEED)], reset_prefix_cache=True),
            _phase("exact_then_blend", [_item(E, blend_recompute_ratios=[1.0])], reset_prefix_cache=True),
            _phase("exact_after_partial_blend", [_item(E, blend=False)]),
        ],
    }
    (work / "job.json").write_text(json.dumps(job))
    plugin_dir = _plugin_path(Path(tempfile.mkdtemp(prefix="plugin-", dir=work)))
    env = job_env(work, plugin_dir)
    with job_slot():  # one of the vLLM processes that may run at once (e2e_support.SLOTS)
        proc = run_script(RUN_BLEND_LLM, [str(work / "job.json")], env, work, 300)  # stdout.txt, stderr.txt in work
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT_JSON:"):
            result: dict[str, Any] = json.loads(line.removeprefix("RESULT_JSON:"))
            # The directory placed every segment and layer-0 object: no tier refused one, none came unplanned.
            assert result["safety_net_firings"] == 0
            assert all(p["counters"].get("scheduler.unplanned_stores", 0) == 0 for p in result["phases"])
            return result
    raise AssertionError(f"run_blend_llm.py exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def _close(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["tokens"] == want["tokens"]
    for step, (g, w) in enumerate(zip(got["logprobs"], want["logprobs"])):
        assert [t for t, _ in g] == [t for t, _ in w], f"step {step}: top tokens differ"
        assert max(abs(a - b) for (_, a), (_, b) in zip(g, w)) <= LOGPROB_ATOL, f"step {step}: logprobs differ"


def _ref(run: dict[str, Any], index: int) -> dict[str, Any]:
    return phase(run, "ref")["outputs"][index]


def test_cold_prompt_stores_each_segment_once(blend_run: dict[str, Any]) -> None:
    seed = phase(blend_run, "seed")
    assert seed["delta"]["blend_scheduler.num_segment_stores"] == 4
    assert seed["delta"]["blend_worker.num_segments_stored"] == 4
    # Each beside its layer-0 attention over itself, where the native kernel runs (it gives the lse).
    native = os.environ["LMI_CACHE_KERNELS"] == "native"
    assert seed["delta"]["blend_worker.num_layer0_attention_stored"] == (4 if native else 0)
    assert seed["delta"]["blend_worker.num_blends"] == 0
    assert seed["counters"]["blend_worker.model_source"] == "plugin"  # vLLM loaded the general plugin


def test_reference_phase_did_not_blend(blend_run: dict[str, Any]) -> None:
    ref = phase(blend_run, "ref")
    assert ref["delta"]["blend_worker.num_blends"] == 0
    assert ref["delta"]["blend_worker.num_segments_loaded"] == 0


def test_ratio_one_loads_segments_and_matches_no_cache(blend_run: dict[str, Any]) -> None:
    got = phase(blend_run, "ratio1")
    assert got["delta"]["blend_worker.num_blends"] == 1
    # D0 is cut by vLLM's own prefix hit of its first block; D2, D1, D3 come from the segment cache.
    assert got["delta"]["blend_worker.num_segments_loaded"] == 3
    assert got["delta"]["blend_worker.num_segment_misses"] == 0
    blended = len(D[2]) + len(D[1]) + len(D[3]) + 3 * len(SEP)
    assert got["delta"]["blend_worker.num_blended_tokens"] == blended
    assert got["outputs"][0]["num_cached_tokens"] == len(B) - len(Q[1])
    _close(got["outputs"][0], _ref(blend_run, 0))


def test_single_segment_at_position_zero_with_ratio_zero_matches_no_cache(blend_run: dict[str, Any]) -> None:
    got = phase(blend_run, "pos0")
    assert got["delta"]["blend_worker.num_segments_loaded"] == 1
    assert got["delta"]["blend_worker.num_recomputed_tokens"] == 0
    assert got["outputs"][0]["num_cached_tokens"] == len(P) - len(Q[2])
    _close(got["outputs"][0], _ref(blend_run, 1))


def test_default_ratio_recomputes_a_fraction(blend_run: dict[str, Any]) -> None:
    got = phase(blend_run, "default")
    blended = len(C) - len(Q[3])
    assert got["delta"]["blend_worker.num_segments_loaded"] == 3
    assert got["delta"]["blend_worker.num_blended_tokens"] == blended
    assert got["delta"]["blend_worker.num_recomputed_tokens"] == int(0.15 * blended)
    assert got["outputs"][0]["num_cached_tokens"] == blended
    assert got["delta"]["worker.num_chunks_saved"] == 0  # nothing exact is saved from blended KV
    assert got["delta"]["blend_worker.num_blend_faults"] == 0
    # The scattered recomputed tokens of layers 1-3 (check layer 1, 4 layers) took lmi-cache's native
    # attention; conftest runs e2e with LMI_CACHE_KERNELS=native unless the caller chose torch.
    native = os.environ["LMI_CACHE_KERNELS"] == "native"
    assert got["delta"]["blend_worker.num_native_attention_layers"] == (3 if native else 0)
    # With it, layer 0 merged each later segment's stored attention over itself; the first segment
    # (at position 0, nothing before it) was attended in full.
    reused = got["delta"]["blend_worker.num_layer0_reused_tokens"]
    assert (0 < reused < blended) if native else reused == 0
    # Not exact at ratio 0.15, but close: the first token (greedy, float32, fixed seeds) is the no-cache one.
    assert got["outputs"][0]["tokens"][0] == _ref(blend_run, 2)["tokens"][0]


def test_explicit_segment_ends_blend_without_separators(blend_run: dict[str, Any]) -> None:
    got = phase(blend_run, "explicit")
    assert got["delta"]["blend_worker.num_segments_loaded"] == 2
    assert got["outputs"][0]["num_cached_tokens"] == len(X_DOCS)


def test_blended_kv_never_serves_an_exact_request(blend_run: dict[str, Any]) -> None:
    exact = phase(blend_run, "exact_after_blend")["outputs"][0]
    assert exact["num_cached_tokens"] == 0  # vLLM's prefix cache and the chunk cache both miss
    assert phase(blend_run, "exact_after_blend")["delta"]["worker.num_chunks_loaded"] == 0
    _close(exact, _ref(blend_run, 2))
    # Control: an exact prompt served earlier does hit vLLM's prefix cache in this same process.
    assert phase(blend_run, "exact_seed_again")["outputs"][0]["num_cached_tokens"] > 0


def test_a_prompt_served_before_is_served_exactly_with_blending_on(blend_run: dict[str, Any]) -> None:
    got = phase(blend_run, "seed_blending_on")
    exact_tokens = (len(SEED) // CHUNK) * CHUNK
    assert got["delta"]["worker.num_chunks_loaded"] == len(SEED) // CHUNK  # the exact prefix chunks won
    assert got["delta"]["blend_worker.num_blends"] == 0
    assert got["outputs"][0]["num_cached_tokens"] == exact_tokens
    assert got["outputs"][0]["tokens"] == _ref(blend_run, 4)["tokens"]  # token ids equal no cache, exactly
    _close(got["outputs"][0], _ref(blend_run, 4))


def test_a_blend_starts_where_the_exact_prefix_ends(blend_run: dict[str, Any]) -> None:
    got = phase(blend_run, "exact_then_blend")
    exact_tokens = (len(SEED) // CHUNK) * CHUNK
    assert got["delta"]["worker.num_chunks_loaded"] == len(SEED) // CHUNK
    assert got["delta"]["blend_worker.num_blends"] == 1
    assert got["delta"]["blend_worker.num_segments_loaded"] == 1  # D1 after the documents the chunks hold
    assert got["delta"]["blend_worker.num_blended_tokens"] == len(D[1]) + len(SEP)
    assert got["delta"]["worker.num_chunks_saved"] == 0  # nothing exact is saved from a blended request
    assert got["outputs"][0]["num_cached_tokens"] == len(E) - len(Q[5])
    assert exact_tokens < len(SEED) - len(Q[0]) < len(E) - len(Q[5])
    _close(got["outputs"][0], _ref(blend_run, 5))
    again = phase(blend_run, "exact_after_partial_blend")["outputs"][0]
    assert again["num_cached_tokens"] == exact_tokens  # the exact part only, never the blended blocks
    _close(again, _ref(blend_run, 5))
