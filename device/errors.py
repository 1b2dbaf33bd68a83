"""The device layer's exception types."""
import torch


class NeuronDeviceError(RuntimeError):
    """A misuse of the emulated device: bad device index, bad configuration, bad state."""


class NeuronDeviceIndexError(NeuronDeviceError, torch.AcceleratorError):
    """A device index outside [0, device_count()). Note [An invalid device is an
    AcceleratorError] (csrc/runtime/guard.cpp): torch.AcceleratorError, a RuntimeError, as
    torch.cuda raises for an invalid device ordinal and as the C++ device guard raises for a
    tensor made on such a device, so one except clause catches both; error_code is CUDA's
    cudaErrorInvalidDevice, as the guard's."""

    error_code = 101


class NeuronInvalidDeviceIdError(NeuronDeviceIndexError, AssertionError):
    """What torch.neuron.get_device_properties (and get_device_name, get_device_capability,
    can_device_access_peer) raise for an index that is not a device, -1 included: torch.cuda's
    raise AssertionError("Invalid device id") there, so this is one too, besides a
    NeuronDeviceIndexError."""


class NeuronConfigError(NeuronDeviceError):
    """An environment variable or setting holds a value we cannot use."""
