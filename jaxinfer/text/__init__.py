"""Text: the tokenizer (tokenizer.json), chat templates, incremental detokenization and stop strings."""
