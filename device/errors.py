"""The device layer's exception types."""


class NeuronDeviceError(RuntimeError):
    """A misuse of the emulated device: bad device index, bad configuration, bad state."""


class NeuronConfigError(NeuronDeviceError):
    """An environment variable or setting holds a value we cannot use."""
