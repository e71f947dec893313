"""The engine: the engine core and its step, the engine clients, and the engine process."""
