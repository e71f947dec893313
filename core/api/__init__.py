"""What the APIs mean, whatever transport carried the request: OpenAI's completions, chat completions, Responses
and embeddings and Anthropic's Messages as calls through the frontend (``calls``), their replies assembled; a chat
turn's tools and the calls read back (``tool_calls``, ``tool_stream``), the thinking split from the answer
(``reasoning``), its prompt, constraint, reader and finish reason (``chat``). The HTTP transport parses and frames
around it; the ZMQ transport's chat turns run through ``chat``. It runs in the frontend process and imports no
tensor library."""
