"""Library-wide settings: how much work one step may hold in memory.

Example:
    >>> import posthoc.settings
    >>> posthoc.settings.chunk_size = 4096   # predict 4,096 examples at a time
"""

#: examples per chunk in ``UncertainModel.predict`` (each chunk is moved to the device in turn)
chunk_size: int = 1024

#: bytes a method may use for one batched sampling step (samples are drawn in chunks below it)
max_memory: int = 1 << 30
