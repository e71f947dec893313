"""The model: Llama-family decoder, checkpoint loaders and tokenizer."""
