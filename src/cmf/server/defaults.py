"""The engine's default limits, importable without numpy or starlette (the CLI parser uses them)."""

DEFAULT_PARALLEL = 16  # sequences decoded together
DEFAULT_KV_BUDGET_MB = 4096  # running sequences' KV plus the prefix cache (vLLM's CPU default: 4 GiB)
DEFAULT_PREFIX_CACHE_MB = 1024  # finished requests' KV kept for later prompts, within the budget
DEFAULT_PREFILL_CHUNK = 256  # prompt tokens fed between two decode steps (the runtime's prefill chunk)
# Least seconds between two hand-overs of one stream's events (its SSE writes); the first and the
# last go at once. 50 ms: each hand-over wakes the event loop and the client on cores that run the
# kernels (figures in docs/SERVER.md); 20 updates a second still read as a smooth stream.
STREAM_INTERVAL = 0.050
