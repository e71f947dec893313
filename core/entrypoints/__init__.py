"""What a user's program or shell starts Conveyor through: the command line (``cli``), the offline ``LLM``, an
engine in the caller's process (``llm``), and the client of a server's ZMQ transport (``zmq_client``)."""
