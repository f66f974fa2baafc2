"""``--enable-lora`` settings (plain data, checked at construction)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAConfig:
    """How many adapters the engine holds, where, and how big they may be."""

    max_loras: int = 4
    """Device slots: the most distinct adapters one step can hold (the scheduler keeps
    the running requests within it)."""
    max_cpu_loras: int | None = None
    """Adapters kept in host memory, ready to move into a slot (least recently used
    leave first); None: the same as ``max_loras``. At least ``max_loras``."""
    max_lora_rank: int = 16
    """The largest rank an adapter may have; slots are sized for it."""
    lora_modules: tuple[tuple[str, str], ...] = ()
    """(name, path) of the adapters served from the start (``--lora-modules name=path``)."""
    allow_runtime_updating: bool = False
    """Whether /v1/load_lora_adapter and /v1/unload_lora_adapter are served."""

    def __post_init__(self) -> None:
        from kvflow.errors import InvalidParameterError

        def require(ok: bool, param: str, msg: str) -> None:
            if not ok:
                raise InvalidParameterError(f"{param} {msg}", param=param)

        require(isinstance(self.max_loras, int) and 1 <= self.max_loras <= 256, "max_loras",
                f"must be in [1, 256], got {self.max_loras!r}")
        require(self.max_cpu_loras is None or isinstance(self.max_cpu_loras, int)
                and self.max_loras <= self.max_cpu_loras <= 4096, "max_cpu_loras",
                f"must be in [max_loras ({self.max_loras}), 4096], got "
                f"{self.max_cpu_loras!r}")
        require(isinstance(self.max_lora_rank, int) and 1 <= self.max_lora_rank <= 512,
                "max_lora_rank", f"must be in [1, 512], got {self.max_lora_rank!r}")
        names = [n for n, _ in self.lora_modules]
        require(len(set(names)) == len(names), "lora_modules",
                f"names must be unique, got {names}")

    @property
    def cpu_capacity(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


def parse_lora_modules(values: list[str] | tuple[str, ...] | None
                       ) -> tuple[tuple[str, str], ...]:
    """``name=path`` items (or JSON objects ``{"name": ..., "path": ...}``, vLLM's other
    form) -> ((name, path), ...)."""
    import json

    from kvflow.errors import InvalidParameterError

    out = []
    for item in values or ():
        if isinstance(item, str) and item.lstrip().startswith("{"):
            try:
                d = json.loads(item)
                name, path = d["name"], d["path"]
            except (ValueError, KeyError, TypeError):
                raise InvalidParameterError(
                    f"lora_modules item {item!r} is not name=path or a JSON object with "
                    "name and path", param="lora_modules") from None
        elif isinstance(item, str) and "=" in item:
            name, path = item.split("=", 1)
        else:
            raise InvalidParameterError(f"lora_modules item {item!r} is not name=path",
                                        param="lora_modules")
        if not name or not path:
            raise InvalidParameterError(f"lora_modules item {item!r} needs a name and a "
                                        "path", param="lora_modules")
        out.append((name, path))
    return tuple(out)
