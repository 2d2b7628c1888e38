"""Container start: configure (files for the server), the checks and summary before vLLM, supervising it, SageMaker deployment."""
