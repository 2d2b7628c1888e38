"""Extra ``lmi-cache`` commands (serve, bench, sagemaker, ...), one module each.

Imported by ``autoconfig.cli`` in the CLI process: list your module in
``autoconfig.cli.COMMAND_MODULES`` and give it ``register(group: click.Group) -> None``
that calls ``group.add_command(your_command)``. Keep module-level imports light
(click and the standard library): ``lmi-cache plan`` must start in well under 1 s,
so import torch/vllm/boto3 inside the command function.
"""
from __future__ import annotations
