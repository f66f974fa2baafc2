"""How large a constraint may be (the counts ``check.py`` enforces), without xgrammar:
the engine's input processor holds these limits, and importing xgrammar (seconds, with
transformers) is left to the first constrained request of an offline ``LLM`` or to the
server's start (``check.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.errors import InvalidParameterError


@dataclass(frozen=True)
class ConstraintLimits:
    """How large a constraint may be; past these a request gets a 400."""

    max_chars: int = 100_000
    """Longest schema (as compact JSON), regex or grammar text, in characters."""
    max_depth: int = 32
    """Deepest nesting of a JSON schema's objects and lists."""
    max_nodes: int = 10_000
    """Most JSON values in a schema (every object, list, string, number counted)."""
    max_enum: int = 2_000
    """Most values in one ``enum`` and choices in ``choice``."""

    def __post_init__(self) -> None:
        for name in ("max_chars", "max_depth", "max_nodes", "max_enum"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidParameterError(f"{name} must be an integer >= 1, got {value!r}",
                                            param=name)


DEFAULT_LIMITS = ConstraintLimits()
