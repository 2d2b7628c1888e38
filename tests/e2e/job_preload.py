"""What the e2e forkserver imports once, before it forks each vLLM job (``warm_start``; test process).

vLLM's modules and what they import (torch, transformers), nothing of lmi-cache:
the code under test is imported fresh in each job. No engine is built here and no
torch operator runs, so no OpenMP thread pool exists to be lost across a fork.
"""
from vllm import LLM, SamplingParams  # noqa: F401
from vllm.config import KVTransferConfig  # noqa: F401
from vllm.inputs import TokensPrompt  # noqa: F401
from vllm.lora.request import LoRARequest  # noqa: F401
