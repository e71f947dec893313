"""Serving: the engine process client, the frontend shared by transports, metrics, and `conveyor serve`."""
