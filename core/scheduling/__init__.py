"""The scheduler's mechanics beside its interface (``conveyor.scheduler``): the record of each step and every end
of a request."""
