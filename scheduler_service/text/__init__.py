"""Text handling on the scheduler: the tokenizer (prompts, chat templates) and the incremental
detokenizer (streamed text, stop strings)."""
