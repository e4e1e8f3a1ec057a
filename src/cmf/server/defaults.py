"""The engine's default limits, importable without numpy or starlette (the CLI parser uses them)."""

DEFAULT_PARALLEL = 16  # sequences decoded together
DEFAULT_KV_BUDGET_MB = 4096  # running sequences' KV plus the prefix cache (vLLM's CPU default: 4 GiB)
DEFAULT_PREFIX_CACHE_MB = 1024  # finished requests' KV kept for later prompts, within the budget
DEFAULT_PREFILL_CHUNK = 256  # prompt tokens fed between two decode steps (the runtime's prefill chunk)
