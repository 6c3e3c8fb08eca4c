"""Model definitions, weight loaders and the tokenizer."""
