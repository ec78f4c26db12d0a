"""The vLLM tests' environment (tests/vllm/, imported first there): a small CPU KV cache, no usage
reports, and vLLM's caches under a temp dir, set before vLLM is imported."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")
os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), "relayrl-vllm-cache"))  # reused, not one per run
