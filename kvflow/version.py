"""kvflow's version (ground floor: the engine's fingerprint and the server read it without
importing the package's face)."""

__version__ = "0.1.0"
