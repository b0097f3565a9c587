"""The engine layer: LLMEngine (requests in, outputs out, one step at a time), LLM (offline generate),
sampling, outputs (text, stop rules, finishes), metrics, the tokenizer and stop strings."""
