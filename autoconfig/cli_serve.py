"""Click commands ``lmi-cache serve`` and ``lmi-cache sagemaker deploy``.

``serve`` runs in the container as its entrypoint; ``sagemaker deploy`` runs
on a developer's machine. Both are thin shells over ``autoconfig.serve.launch`` and
``autoconfig.serve.sagemaker_deploy``. ``autoconfig.cli`` adds them to the
``lmi-cache`` group through ``register``; user errors become one line and
exit 2 there (and in this module's own ``main`` for ``python -m``).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from autoconfig.cli_inputs import host_options


def _listen_address(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """vLLM's --host; a snapshot file there is the old spelling of --host-snapshot."""
    if value is not None and (value.endswith(".json") or Path(value).is_file()):
        raise click.BadParameter(f"{value[:80]!r} is a file: --host is the address vLLM listens on (as in vLLM); "
                                 f"give a host snapshot with --host-snapshot {value[:80]}")
    if value is not None and (not value.strip() or any(c.isspace() for c in value)):
        raise click.BadParameter(f"{value[:80]!r} is not an address to listen on")
    return value


@click.command()
# SageMaker starts images as `docker run IMAGE serve`: with ENTRYPOINT ["lmi-cache", "serve"]
# that arrives here as one extra word, accepted and ignored.
@click.argument("sagemaker_arg", required=False, metavar="[serve]", type=click.Choice(["serve"]))
@click.option("--model-dir", type=click.Path(file_okay=False),
              help="Model directory with serving.properties and/or the model (default /opt/ml/model).")
@lambda func: host_options(func, old_spelling=False)
@click.option("--host", "bind_host", callback=_listen_address,
              help="Address vLLM listens on (vLLM's --host; default 0.0.0.0).")
@click.option("--port", "bind_port", type=click.IntRange(1, 65535),
              help="Port vLLM listens on (vLLM's --port; default $SAGEMAKER_BIND_TO_PORT or 8080).")
@click.option("--dry-run", is_flag=True, help="Print the summary and the vLLM command instead of starting it.")
def serve(sagemaker_arg: str | None, model_dir: str | None, host_file: str | None, instance_type: str | None,
          bind_host: str | None, bind_port: int | None, dry_run: bool) -> None:
    """Container entrypoint: configure the KV cache, then run vLLM's OpenAI server on :8080."""
    import os
    from pathlib import Path

    from autoconfig.cli_inputs import HostSource, model_weights
    from autoconfig.serve.configure import DEFAULT_MODEL_DIR
    from autoconfig.serve.launch import run_serve

    source = HostSource(host_file, instance_type)
    host = None
    if not source.live:
        host = source.load(model_weights(Path(model_dir or DEFAULT_MODEL_DIR), os.environ, {}))
    status = run_serve(model_dir, dry_run, host=host, echo=click.echo, bind=(bind_host, bind_port))
    if status:
        sys.exit(status)


@click.group()
def sagemaker() -> None:
    """Deploy the lmi-cache container to Amazon SageMaker."""


@sagemaker.command()
@click.option("--name", required=True, help="Name of the model, endpoint config and endpoint.")
@click.option("--image", "image_uri", required=True, help="Container image URI (ECR).")
@click.option("--model-data", help="s3:// prefix (uncompressed model) or s3://.../model.tar.gz.")
@click.option("--instance-type", required=True, help="e.g. ml.g6e.12xlarge")
@click.option("--role", "role_arn", required=True, help="SageMaker execution role ARN.")
@click.option("--option", "option_pairs", multiple=True, metavar="KEY=VALUE",
              help="LMI option, sent as env OPTION_<KEY> (repeatable), e.g. tensor_parallel_degree=4.")
@click.option("--env", "env_pairs", multiple=True, metavar="NAME=VALUE",
              help="Other container environment variable (repeatable), e.g. HF_TOKEN=hf_...; secrets are never "
                   "printed.")
@click.option("--instance-count", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--startup-timeout", "startup_timeout_s", type=int, default=1800, show_default=True,
              help="Seconds SageMaker waits for the model download and for /ping (60-3600, SageMaker's limit).")
@click.option("--region", help="AWS region (default: the AWS configuration).")
@click.option("--endpoint-url", help="SageMaker API endpoint (e.g. a local test server).")
@click.option("--dry-run", is_flag=True, help="Print the three requests as JSON; send nothing.")
def deploy(name: str, image_uri: str, model_data: str | None, instance_type: str, role_arn: str,
           option_pairs: tuple[str, ...], env_pairs: tuple[str, ...], instance_count: int, startup_timeout_s: int,
           region: str | None, endpoint_url: str | None, dry_run: bool) -> None:
    """Create a SageMaker model, endpoint config and endpoint with the KV cache on."""
    from autoconfig.serve.sagemaker_deploy import (
        DeploySpec,
        build_requests,
        deploy as send,
        parse_env_pairs,
        parse_option_pairs,
        printable,
    )

    spec = DeploySpec(name=name, image_uri=image_uri, instance_type=instance_type, role_arn=role_arn,
                      model_data=model_data, options=parse_option_pairs(option_pairs),
                      instance_count=instance_count, startup_timeout_s=startup_timeout_s,
                      env=parse_env_pairs(env_pairs))
    requests = build_requests(spec)
    if dry_run:
        click.echo(json.dumps(printable(requests), indent=2))
        return
    arns = send(requests, region=region, endpoint_url=endpoint_url)
    for key, arn in arns.items():
        click.echo(f"{key}: {arn}")
    click.echo(f"endpoint {name} is being created; wait with: aws sagemaker wait endpoint-in-service "
               f"--endpoint-name {name}")


def register(group: click.Group) -> None:
    """Called by autoconfig.cli: adds this module's commands to ``lmi-cache``."""
    group.add_command(serve)
    group.add_command(sagemaker)


def main() -> None:
    """``python -m autoconfig.cli_serve ...``: the same commands under the lmi-cache error handling."""
    from autoconfig.cli import LmiCacheGroup

    group = LmiCacheGroup(name="lmi-cache", help="lmi-cache serve / sagemaker")
    register(group)
    group.main(sys.argv[1:], prog_name="lmi-cache")


if __name__ == "__main__":
    main()
