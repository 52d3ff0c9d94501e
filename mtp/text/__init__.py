"""Text in and out of the model: `tokenizer.py` (tokenizer files with DeepSeek-V3.2's special tokens, streamed
decoding), `prompt.py` (the DeepSeek-V3.2 chat format: messages -> prompt ids, and a completion back to an
OpenAI-style message), `dsml.py` (tool calls and schemas in DeepSeek's DSML format)."""
