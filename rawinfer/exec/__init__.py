"""Execution: the memory pool (weights, workspace, KV blocks in one arena), the model's forward pass over
the op interface, the runner that executes step plans, and decode graphs."""
