"""Network front ends of the engine."""
