"""The device layer's exception types."""


class NeuronDeviceError(RuntimeError):
    """A misuse of the emulated device: bad device index, bad configuration, bad state."""


class NeuronDeviceIndexError(NeuronDeviceError, IndexError):
    """A device index outside [0, device_count()): an IndexError too, as the C++ device guard
    raises for a tensor made on such a device (TORCH_CHECK_INDEX), so one except clause
    catches both."""


class NeuronConfigError(NeuronDeviceError):
    """An environment variable or setting holds a value we cannot use."""
