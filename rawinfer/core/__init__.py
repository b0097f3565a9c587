"""The engine's core, free of any array library: sequences, the paged KV block manager and its free list,
the continuous-batching scheduler and the step plan it builds for the runner."""
