"""Training of speculative heads (``kvflow train-medusa``, ``kvflow train-eagle``): a room
of its own outside the serving path. It uses the engine (generation, hidden states) and
writes heads that ``kvflow.spec_decode`` loads; nothing in serving imports it."""
