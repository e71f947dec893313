"""What a chat request means, whatever transport carried it: the tools shown to the model and the calls read
back (``tool_calls``, ``tool_stream``), the thinking split from the answer (``reasoning``), and a chat turn's
prompt, constraints and reply reader (``chat``). The HTTP and ZMQ transports both answer through it; it runs in the
frontend process and imports no tensor library."""
