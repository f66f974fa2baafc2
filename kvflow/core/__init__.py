"""The engine core's pure-Python half: requests, KV block accounting and scheduling.

Nothing here imports torch (a test proves it); the worker reads the plain data it makes.
"""

from kvflow.core.block_pool import BlockPool, KVBlock
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.request import Request, RequestStatus
from kvflow.core.sched_output import (
    CachedRequestData,
    EngineCoreRequest,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from kvflow.core.scheduler import Scheduler, check_request_fits

__all__ = [
    "BlockPool", "KVBlock", "KVCacheManager", "Request", "RequestStatus", "Scheduler",
    "SchedulerOutput", "NewRequestData", "CachedRequestData", "ModelRunnerOutput",
    "EngineCoreOutput", "EngineCoreRequest", "check_request_fits",
]
