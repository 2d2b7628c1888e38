"""``lmi-cache bench``: a thin click shell over the bench runner (bench process).

Registered in the ``lmi-cache`` group by autoconfig's CLI and runnable alone
as ``python -m lmi_cache.bench``. User errors (unreachable server, HTTP
errors, bad options) print one line and exit 2.
"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from lmi_cache.errors import UserError

if TYPE_CHECKING:
    from lmi_cache.bench.runner import BenchResult

WORKLOADS = ("long-doc-qa", "multi-round-chat")
# Long-document QA documents are long; a chat user's opening context is shorter.
DEFAULT_DOCUMENT_TOKENS = {"long-doc-qa": 8000, "multi-round-chat": 1000}

_positive = click.IntRange(min=1)


async def run_bench(
    *,
    url: str,
    model: str | None,
    workload: str,
    num_documents: int,
    document_tokens: int,
    query_tokens: int,
    output_tokens: int,
    concurrency: int,
    num_users: int,
    num_rounds: int,
    seed: int,
    tokenizer: str | None,
    timeout_s: float,
    ignore_eos: bool,
) -> BenchResult:
    """The whole run: pick a model and a token counter, then run the workload."""
    # Imported here so that registering the command in ``lmi-cache`` stays
    # cheap: aiohttp loads only when a benchmark actually runs.
    from lmi_cache.bench.client import OpenAiClient
    from lmi_cache.bench.runner import run_long_doc_qa, run_multi_round_chat
    from lmi_cache.bench.tokens import pick_token_counter
    from lmi_cache.bench.workloads import LongDocQaSpec, MultiRoundChatSpec

    extra_body = {"ignore_eos": True} if ignore_eos else {}
    async with OpenAiClient(url, model, timeout_s=timeout_s, extra_body=extra_body) as client:
        await client.resolve_model()
        counter = await pick_token_counter(client, tokenizer)
        if workload == "long-doc-qa":
            spec = LongDocQaSpec(num_documents, document_tokens, query_tokens, output_tokens, seed)
            return await run_long_doc_qa(client, spec, counter, concurrency)
        chat = MultiRoundChatSpec(num_users, num_rounds, document_tokens, query_tokens, output_tokens, seed)
        return await run_multi_round_chat(client, chat, counter, concurrency)


@click.command("bench")
@click.option("--url", default="http://127.0.0.1:8080", show_default=True, help="OpenAI-compatible server base URL.")
@click.option("--model", default=None, help="Model name to request [default: the server's first model].")
@click.option("--workload", type=click.Choice(WORKLOADS), default="long-doc-qa", show_default=True)
@click.option("--num-documents", type=_positive, default=8, show_default=True, help="long-doc-qa: documents.")
@click.option(
    "--document-tokens",
    type=_positive,
    default=None,
    help="Tokens per document (long-doc-qa, default 8000) or per user's opening context (chat, default 1000).",
)
@click.option("--query-tokens", type=_positive, default=32, show_default=True, help="Tokens per question.")
@click.option("--output-tokens", type=_positive, default=16, show_default=True, help="max_tokens per request.")
@click.option("--concurrency", type=_positive, default=4, show_default=True, help="Requests in flight at most.")
@click.option("--num-users", type=_positive, default=4, show_default=True, help="multi-round-chat: users.")
@click.option("--num-rounds", type=_positive, default=4, show_default=True, help="multi-round-chat: rounds.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random words.")
@click.option("--tokenizer", default=None, help="Local tokenizer (folder or tokenizer.json) to count tokens.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True)
@click.option("--ignore-eos/--no-ignore-eos", default=False, show_default=True, help="vLLM: always generate max_tokens.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write results as JSON here.")
def bench(
    url: str,
    model: str | None,
    workload: str,
    num_documents: int,
    document_tokens: int | None,
    query_tokens: int,
    output_tokens: int,
    concurrency: int,
    num_users: int,
    num_rounds: int,
    seed: int,
    tokenizer: str | None,
    timeout_s: float,
    ignore_eos: bool,
    json_path: Path | None,
) -> None:
    """Measure TTFT and round latency with a long-document QA or multi-round chat workload."""
    from lmi_cache.bench.report import text_report, to_json

    try:
        result = asyncio.run(
            run_bench(
                url=url,
                model=model,
                workload=workload,
                num_documents=num_documents,
                document_tokens=document_tokens or DEFAULT_DOCUMENT_TOKENS[workload],
                query_tokens=query_tokens,
                output_tokens=output_tokens,
                concurrency=concurrency,
                num_users=num_users,
                num_rounds=num_rounds,
                seed=seed,
                tokenizer=tokenizer,
                timeout_s=timeout_s,
                ignore_eos=ignore_eos,
            )
        )
        if json_path is not None:
            try:
                json_path.write_text(to_json(result) + "\n")
            except OSError as err:
                raise UserError(f"--json {json_path}: cannot write it ({err.strerror}); pick a writable path") from None
    except UserError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    click.echo(text_report(result))


def main() -> None:
    bench(prog_name="lmi-cache bench")


def register(group: click.Group) -> None:
    """Called by autoconfig.cli: adds ``lmi-cache bench``."""
    group.add_command(bench)
