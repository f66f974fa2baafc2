"""The engine: tokenization, the step loop, the engine-core process and output processing."""
