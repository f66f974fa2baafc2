"""Multi-LoRA serving (docs/lora.md): PEFT adapters applied per request, batched.

``request`` and ``config`` are plain data (the scheduler and the API read them, no
torch); ``adapter`` reads and checks PEFT directories; ``layers`` wraps a linear layer's
method so it adds each row's adapter delta; ``slots`` keeps adapters in device slots and a
host cache; ``worker`` ties them to the model runner's steps.
"""

from kvflow.lora.config import LoRAConfig
from kvflow.lora.request import LoRARequest

__all__ = ["LoRAConfig", "LoRARequest"]
