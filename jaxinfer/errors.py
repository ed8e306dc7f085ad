"""Errors a user can cause. The CLI prints them as one line and exits with code 2."""


class JaxinferError(Exception):
    """Base class for errors caused by the user's input (a model folder, a prompt, a parameter)."""


class ModelLoadError(JaxinferError, ValueError):
    """A model folder that is missing, incomplete, corrupt or of an unsupported architecture."""


class PromptTooLongError(JaxinferError, ValueError):
    """A prompt that leaves no room in the context window."""


class DeviceMemoryError(JaxinferError, MemoryError):
    """A step that ran out of device memory: the KV pool, sized at start-up from the memory left after the weights,
    left the step's temporaries too little (the settings that shrink the pool are in the message)."""
