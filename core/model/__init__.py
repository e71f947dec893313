"""The model: the decoder of every family (Llama's block with each family's quirks), checkpoint loaders and
tokenizer."""
