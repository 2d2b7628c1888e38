"""LMCACHE_* variables, an LMCache YAML, option.*/OPTION_* and flags are checked once, with the same messages.

``serve --dry-run`` and ``plan`` refuse a tier that does not fit the host whichever way in set it, show
the tiers that will run (and what auto-configuration would size instead), and ``configure`` writes the
vLLM arguments serve passes.
"""
from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from autoconfig.cli import main

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "tests" / "fixtures" / "hf_configs" / "llama-3.1-8b-instruct"
SMALL = ["--instance-type", "ml.g5.2xlarge"]  # 32 GiB of RAM, one A10G
FIT = "GiB per rank does not fit: at most"


def model_dir(tmp_path: Path, properties: str = "", yaml: str | None = None) -> Path:
    mdir = tmp_path / "model"
    mdir.mkdir(parents=True, exist_ok=True)
    shutil.copy(MODEL / "config.json", mdir / "config.json")
    (mdir / "serving.properties").write_text("option.max_model_len=8192\n" + properties)
    if yaml is not None:
        (mdir / "lmcache.yaml").write_text(yaml)
    return mdir


def run(args: list[str], tmp_path: Path, **env: str) -> Result:
    return CliRunner().invoke(main, args, env={"LMI_CACHE_RUNTIME_DIR": str(tmp_path / "runtime"), **env})


def dry_run(mdir: Path, tmp_path: Path, **env: str) -> Result:
    return run(["serve", "--dry-run", "--model-dir", str(mdir), *SMALL], tmp_path, **env)


def error_line(result: Result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmi-cache: error: "), result.stderr
    return lines[0][len("lmi-cache: error: "):]


@pytest.mark.parametrize("command", ["serve", "plan"])
def test_a_cpu_tier_too_big_for_the_host_is_refused_whichever_way_in(command: str, tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, yaml="chunk_size: 256\nmax_local_cpu_size: 5000\n")
    args = (["serve", "--dry-run"] if command == "serve" else ["plan"]) + ["--model-dir", str(mdir), *SMALL]
    ways = {
        "environment variable LMCACHE_MAX_LOCAL_CPU_SIZE": {"LMCACHE_MAX_LOCAL_CPU_SIZE": "5000"},
        "environment variable OPTION_LMCACHE_MAX_LOCAL_CPU_SIZE": {"OPTION_LMCACHE_AUTO_CONFIG": "true",
                                                                  "OPTION_LMCACHE_MAX_LOCAL_CPU_SIZE": "5000"},
        f"{mdir / 'lmcache.yaml'}: max_local_cpu_size": {"OPTION_LMCACHE_CONFIG_FILE": "lmcache.yaml"},
    }
    tails = set()
    for name, env in ways.items():
        line = error_line(run(args, tmp_path, **env))
        assert f"{name}=5000" in line and FIT in line, line
        tails.add(line.split(FIT, 1)[1])
    assert len(tails) == 1, tails  # the same check, the same message after the name


@pytest.mark.parametrize("command", ["serve", "plan"])
def test_a_chunk_size_vllm_cannot_use_is_refused_whichever_way_in(command: str, tmp_path: Path) -> None:
    mdir = model_dir(tmp_path)
    args = (["serve", "--dry-run"] if command == "serve" else ["plan"]) + ["--model-dir", str(mdir), *SMALL]
    env_line = error_line(run(args, tmp_path, LMCACHE_CHUNK_SIZE="100"))
    option_line = error_line(run(args, tmp_path, OPTION_LMCACHE_AUTO_CONFIG="true", OPTION_LMCACHE_CHUNK_SIZE="100"))
    assert env_line == "environment variable LMCACHE_CHUNK_SIZE=100: must be a positive multiple of vLLM's block " \
                       "size 16 on this backend"
    assert option_line == env_line.replace("LMCACHE_CHUNK_SIZE", "OPTION_LMCACHE_CHUNK_SIZE")


def test_a_yaml_value_an_lmcache_variable_overrides_is_not_refused(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "option.lmcache_config_file=lmcache.yaml\n", "chunk_size: 256\nmax_local_cpu_size: 40\n")
    result = dry_run(mdir, tmp_path, LMCACHE_MAX_LOCAL_CPU_SIZE="20")
    assert result.exit_code == 0, result.output
    assert f"cache: LMCache config from {mdir / 'lmcache.yaml'} (CPU tier 20.00 GiB/rank;" in result.stdout
    assert "max_local_cpu_size=40" in error_line(dry_run(mdir, tmp_path))  # without the variable: refused


def test_an_lmcache_variable_over_the_planned_yaml_is_checked(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "option.lmcache_auto_config=true\n")
    line = error_line(dry_run(mdir, tmp_path, LMCACHE_MAX_LOCAL_CPU_SIZE="5000"))
    assert line.startswith("environment variable LMCACHE_MAX_LOCAL_CPU_SIZE=5000") and FIT in line


@pytest.mark.parametrize("as_json", [False, True])
def test_plan_with_lmcache_variables_alone_shows_their_tiers(as_json: bool, tmp_path: Path) -> None:
    mdir = model_dir(tmp_path)
    result = run(["plan", "--model-dir", str(mdir), *SMALL] + (["--json"] if as_json else []), tmp_path,
                 LMCACHE_CHUNK_SIZE="512", LMCACHE_MAX_LOCAL_CPU_SIZE="3")
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    if not as_json:
        assert "cache: from LMCACHE_* variables, with the tiers above" in result.stdout
        assert "auto-configuration would size instead: CPU tier" in result.stdout
        return
    plan = json.loads(result.stdout)
    assert plan["serve"]["cache_mode"] == "env" and plan["chunk_size"] == 512
    assert plan["tiers"]["cpu"]["bytes_per_rank"] == 3 << 30 and not plan["tiers"]["disk"]["enabled"]
    assert plan["serve"]["auto_config_would_size"]["chunk_size"] == 256


def test_plan_and_serve_show_the_users_yaml_tiers_and_the_auto_comparison(tmp_path: Path) -> None:
    yaml = "chunk_size: 512\nmax_local_cpu_size: 6\n"
    mdir = model_dir(tmp_path, "option.lmcache_config_file=lmcache.yaml\n", yaml)
    plan = json.loads(run(["plan", "--model-dir", str(mdir), *SMALL, "--json"], tmp_path).stdout)
    assert plan["chunk_size"] == 512 and plan["tiers"]["cpu"]["bytes_per_rank"] == 6 << 30
    served = dry_run(mdir, tmp_path)
    assert "cache: LMCache config from" in served.stdout and "(CPU tier 6.00 GiB/rank; disk tier off; chunk 512 " \
        "tokens)" in served.stdout
    auto = plan["serve"]["auto_config_would_size"]
    assert f"auto-configuration would size instead: CPU tier {auto['tiers']['cpu']['bytes_per_rank'] / (1 << 30):.2f}" \
        in served.stdout


def test_configure_writes_the_vllm_arguments_serve_passes(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "option.lmcache_auto_config=true\noption.max_num_seqs=32\n"
                               "option.trust_remote_code=true\n")
    out = tmp_path / "out"
    result = run(["configure", "--model-dir", str(mdir), "--output-dir", str(out), *SMALL], tmp_path)
    assert result.exit_code == 0, result.output
    written = json.loads((out / "vllm_args.json").read_text())
    assert written[written.index("--max-num-seqs") + 1] == "32" and "--trust-remote-code" in written
    assert json.loads((out / "plan.json").read_text())["vllm_args"] == written
    served = dry_run(mdir, tmp_path)
    argv = shlex.split(next(ln for ln in served.stdout.splitlines() if ln.startswith("exec: "))[6:])
    start = argv.index("--model") + 2
    assert argv[start:start + len(written)] == written  # serve runs exactly what configure wrote
    planned = json.loads(run(["plan", "--model-dir", str(mdir), *SMALL, "--json"], tmp_path).stdout)
    assert planned["vllm_args"] == written


def test_a_planner_refusal_names_the_flag_as_typed(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "option.lmcache_auto_config=true\n")
    line = error_line(run(["plan", "--model-dir", str(mdir), *SMALL, "--chunk-size", "100"], tmp_path))
    assert line.startswith("--chunk-size=100: must be a positive multiple of vLLM's block size"), line
    line = error_line(run(["plan", "--model-dir", str(mdir), *SMALL, "--disk-size-gib", "100000"], tmp_path))
    assert line.startswith("--disk-size-gib=100000.0 GiB per rank does not fit"), line


HOLDERS = "valkey://records:6379"  # a Redis/Valkey for the peer tier's holder records only


@pytest.mark.parametrize("way", ["option", "OPTION_env", "LMCACHE_env", "yaml"])
def test_the_peer_tier_is_planned_alike_whichever_way_in(way: str, tmp_path: Path) -> None:
    properties, env, yaml = "", {}, None
    if way == "option":
        properties = ("option.lmcache_auto_config=true\noption.lmcache_enable_p2p=true\n"
                      "option.lmcache_p2p_init_ports=9100\noption.lmcache_p2p_lookup_ports=9101\n"
                      f"option.lmcache_peer_holders_url={HOLDERS}\n")
    elif way == "OPTION_env":
        env = {"OPTION_LMCACHE_AUTO_CONFIG": "true", "OPTION_LMCACHE_ENABLE_P2P": "true",
               "OPTION_LMCACHE_P2P_INIT_PORTS": "9100", "OPTION_LMCACHE_P2P_LOOKUP_PORTS": "9101",
               "OPTION_LMCACHE_PEER_HOLDERS_URL": HOLDERS}
    elif way == "LMCACHE_env":
        env = {"LMCACHE_ENABLE_P2P": "true", "LMCACHE_P2P_INIT_PORTS": "9100", "LMCACHE_P2P_LOOKUP_PORTS": "9101",
               "LMCACHE_EXTRA_CONFIG": json.dumps({"peer_holders_url": HOLDERS})}
    else:
        properties = "option.lmcache_config_file=lmcache.yaml\n"
        yaml = ("chunk_size: 256\nmax_local_cpu_size: 4\nenable_p2p: true\np2p_init_ports: [9100]\n"
                f"p2p_lookup_ports: [9101]\nextra_config:\n  peer_holders_url: {HOLDERS}\n")
    mdir = model_dir(tmp_path, properties, yaml)
    planned = run(["plan", "--model-dir", str(mdir), *SMALL, "--json"], tmp_path, **env)
    assert planned.exit_code == 0, planned.output
    plan = json.loads(planned.stdout)
    assert plan["tiers"]["peer"] == {"host": "127.0.0.1", "init_ports": [9100], "lookup_ports": [9101],
                                     "transport": "tcp", "timeout_ms": 2000,
                                     "holders": {"url": HOLDERS, "store": "peer_holders_url"}}
    assert "remote" not in plan["tiers"]  # the records' store is no remote tier: no KV is copied there
    holders = f"holders: records in {HOLDERS} (peer_holders_url, no KV there)"
    text = run(["plan", "--model-dir", str(mdir), *SMALL], tmp_path, **env).stdout
    assert "Peer tier" in text and f"ports [9100] / [9101], over tcp; {holders}" in text
    served = dry_run(mdir, tmp_path, **env)
    assert served.exit_code == 0 and "Traceback" not in served.output, served.output
    cache_line = next(line for line in served.output.splitlines() if "cache: " in line)
    assert f"peer tier on at 127.0.0.1, ports [9100] / [9101], over tcp; {holders}" in cache_line, cache_line
    assert (plan["serve"]["cache_mode"] == "auto") == (way in ("option", "OPTION_env"))
    if plan["serve"]["cache_mode"] == "auto":  # the planned YAML (what serve writes) carries the plan
        from lmi_cache.config.cache_config import config_from_dict

        config, _ = config_from_dict(plan["lmcache_config"])
        assert config.enable_p2p and config.p2p_init_ports == (9100,) and config.p2p_lookup_ports == (9101,)
        assert config.peer_transport == "tcp" and config.peer_holders_url == HOLDERS and config.remote_url is None


def test_the_plan_says_how_a_request_without_a_hint_finds_a_peer(tmp_path: Path) -> None:
    base = "option.lmcache_auto_config=true\noption.lmcache_enable_p2p=true\n"
    remote = "option.lmcache_remote_url=redis://cache:6379\n"
    own = f"option.lmcache_peer_holders_url={HOLDERS}\n"
    lines = {}
    for name, extra in (("alone", ""), ("shared", remote), ("own", own), ("both", remote + own)):
        result = run(["plan", "--model-dir", str(model_dir(tmp_path / name, base + extra)), *SMALL], tmp_path)
        assert result.exit_code == 0, result.output
        lines[name] = next(line for line in result.stdout.splitlines() if line.startswith("Peer tier"))
        assert "without a hint" in result.stdout
    assert "holders: router hints only" in lines["alone"]
    assert "holders: records in the remote store redis://cache:6379" in lines["shared"]
    assert f"holders: records in {HOLDERS} (peer_holders_url, no KV there)" in lines["own"]
    assert lines["both"] == lines["own"]  # the records' own store wins over the remote tier's
    off = run(["plan", "--model-dir", str(model_dir(tmp_path / "off", "option.lmcache_auto_config=true\n" + own)),
               *SMALL], tmp_path)
    assert off.exit_code == 0 and "! lmcache_peer_holders_url ignored: it is where the peer tier finds holders, " \
                                  "and the peer tier is off" in off.stdout, off.output


def test_a_holder_store_that_is_not_redis_or_valkey_is_refused_whichever_way_in(tmp_path: Path) -> None:
    base = "option.lmcache_auto_config=true\noption.lmcache_enable_p2p=true\n"
    option = model_dir(tmp_path / "option", base + "option.lmcache_peer_holders_url=s3://u:secret@bucket/kv\n")
    line = error_line(run(["plan", "--model-dir", str(option), *SMALL], tmp_path))
    assert "option.lmcache_peer_holders_url" in line and "Redis or Valkey" in line and "secret" not in line
    yaml = model_dir(tmp_path / "yaml", "option.lmcache_config_file=lmcache.yaml\n",
                     "chunk_size: 256\nenable_p2p: true\nextra_config:\n  peer_holders_url: redis://u:secret@:6379\n")
    line = error_line(run(["plan", "--model-dir", str(yaml), *SMALL], tmp_path))
    assert "extra_config.peer_holders_url" in line and "has no host" in line and "secret" not in line


def test_peer_ports_that_do_not_fit_the_ranks_are_refused(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "option.lmcache_auto_config=true\noption.lmcache_enable_p2p=true\n"
                               "option.lmcache_p2p_init_ports=9100\noption.lmcache_p2p_lookup_ports=9101,9103\n")
    line = error_line(run(["plan", "--model-dir", str(mdir), "--instance-type", "ml.g5.12xlarge", "--tp", "2"],
                          tmp_path))
    assert "one port per rank (2: tp x pp)" in line and "p2p_lookup_ports" in line
    bad = model_dir(tmp_path / "bad", "option.lmcache_auto_config=true\noption.lmcache_p2p_init_ports=http\n")
    assert "option.lmcache_p2p_init_ports" in error_line(run(["plan", "--model-dir", str(bad), *SMALL], tmp_path))


def test_validate_reports_peer_settings_that_do_not_pair_up(tmp_path: Path) -> None:
    mdir = model_dir(tmp_path, "option.lmcache_config_file=lmcache.yaml\n",
                     "chunk_size: 256\nmax_local_cpu_size: 4\nenable_p2p: true\np2p_init_ports: [9100]\n")
    result = run(["validate", str(mdir / "lmcache.yaml"), "--model", str(MODEL), *SMALL], tmp_path)
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "enable_p2p with p2p_init_ports but not the other" in result.output
