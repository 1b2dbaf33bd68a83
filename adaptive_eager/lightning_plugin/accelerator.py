"""PyTorch Lightning's `Trainer(accelerator="neuron", devices=N)`.

Note [Lightning's neuron accelerator]: Lightning resolves `accelerator=` by name in its
AcceleratorRegistry, which device vendors extend with an Accelerator subclass. Ours registers
there when Lightning is imported (import_hook.py), for both of its packages (`lightning.pytorch`
and the standalone `pytorch_lightning`, the same code under two names, each with its own
registry and base classes). Two of the Trainer's choices know only the devices Lightning ships:
- with one device and `strategy="auto"` it builds `SingleDeviceStrategy(device="cpu")` for any
  accelerator but CUDA and MPS (`_AcceleratorConnector._choose_strategy`), so the model would
  train on the CPU root device;
- DDP picks its process-group backend from the root device: NCCL for CUDA, gloo for anything
  else, and gloo's groups have no backend for `neuron` tensors; and it wraps the model inside
  `torch.cuda.stream(torch.cuda.Stream())` for any device but the CPU.
So the connector is extended, for a neuron accelerator only: the auto strategy's single device
is the accelerator's first device, and Lightning's own DDPStrategy (`"ddp"`, `"ddp_spawn"`,
`"ddp_fork"`, or auto with several devices) becomes NeuronDDPStrategy, the same strategy with
"neuron" as its backend unless one is given (torch.distributed's neuron backend,
dispatch/distributed.py) and the model wrapped on a neuron side stream. Every other
accelerator goes through Lightning's code untouched.
"""
from __future__ import annotations

import importlib

import torch

NAME = "neuron"
_PATCHED = "_adaptive_eager_neuron"
CLASSES: dict[str, type] = {}  # the NeuronAccelerator of each Lightning package registered


def _parse_devices(devices) -> list[int]:
    """Lightning's forms of `devices=`: a count, -1 or "auto" (all), "0,2" or [0, 2] (these
    indices). Each index is checked against the device count, saying how to set it."""
    count = torch.neuron.device_count()
    if devices in (-1, "-1", "auto"):
        indices = list(range(count))
    elif isinstance(devices, int) or (isinstance(devices, str) and devices.strip().isdigit()):
        n = int(devices)
        if n < 1 or n > count:
            raise ValueError(
                f"Trainer(accelerator='neuron', devices={devices!r}) asks for {n} devices, but {count} are "
                f"emulated. Ask for 1 to {count}, or emulate more with NEURON_DEVICE_COUNT=N in the environment "
                f"before `import torch`.")
        indices = list(range(n))
    elif isinstance(devices, (list, tuple)) or isinstance(devices, str):
        parts = devices.split(",") if isinstance(devices, str) else devices
        try:
            indices = [int(p) for p in parts if str(p).strip() != ""]
        except ValueError:
            raise ValueError(f"Trainer(accelerator='neuron', devices={devices!r}): give a count, -1, 'auto', or "
                             f"device indices such as [0, 1] or '0,1'.") from None
        bad = [i for i in indices if not 0 <= i < count]
        if bad or not indices or len(set(indices)) != len(indices):
            raise ValueError(
                f"Trainer(accelerator='neuron', devices={devices!r}): indices must be distinct and in [0, {count}) "
                f"({count} devices are emulated; NEURON_DEVICE_COUNT=N emulates more).")
    else:
        raise TypeError(f"Trainer(accelerator='neuron', devices={devices!r}): give a count, -1, 'auto', or device "
                        f"indices such as [0, 1] or '0,1', not {type(devices).__name__}.")
    return indices


def _accelerator_class(accelerator_base: type) -> type:
    class NeuronAccelerator(accelerator_base):
        """The emulated Trainium device as a Lightning accelerator."""

        def setup_device(self, device: torch.device) -> None:
            if device.type != NAME:
                raise ValueError(
                    f"NeuronAccelerator was given the root device {device}: a strategy built for another "
                    f"device. Leave strategy='auto', or give one for neuron, e.g. "
                    f"SingleDeviceStrategy(device='neuron:0') or DDPStrategy(process_group_backend='neuron').")
            torch.neuron.set_device(device)

        def teardown(self) -> None:
            torch.neuron.empty_cache()

        @staticmethod
        def parse_devices(devices) -> list[int]:
            return _parse_devices(devices)

        @staticmethod
        def get_parallel_devices(devices: list[int]) -> list[torch.device]:
            return [torch.device(NAME, i) for i in devices]

        @staticmethod
        def auto_device_count() -> int:
            return torch.neuron.device_count()

        @staticmethod
        def is_available() -> bool:
            return torch.neuron.is_available()

        @staticmethod
        def name() -> str:
            return NAME

        def get_device_stats(self, device) -> dict:
            return dict(torch.neuron.memory_stats(device))

        @classmethod
        def register_accelerators(cls, accelerator_registry) -> None:
            accelerator_registry.register(NAME, cls, description=cls.__name__)

    return NeuronAccelerator


def _ddp_class(ddp_base: type) -> type:
    class NeuronDDPStrategy(ddp_base):
        """Lightning's DDPStrategy on neuron devices: only the device-specific parts differ, so
        it adds no state (the connector turns a DDPStrategy into one by its class)."""

        def _get_process_group_backend(self) -> str:
            return self._process_group_backend or NAME

        def _setup_model(self, model):
            from torch.nn.parallel import DistributedDataParallel

            # As Lightning does on CUDA: DDP's construction-time broadcasts on a side stream.
            with torch.neuron.stream(torch.neuron.Stream()):
                return DistributedDataParallel(module=model, device_ids=self.determine_ddp_device_ids(),
                                               **self._ddp_kwargs)

    return NeuronDDPStrategy


def _extend_connector(package: str, accelerator_class: type) -> None:
    """Note [Lightning's neuron accelerator]: the two choices made for neuron, and only for it."""
    connector = importlib.import_module(f"{package}.trainer.connectors.accelerator_connector")
    strategies = importlib.import_module(f"{package}.strategies")
    cls = connector._AcceleratorConnector
    if getattr(cls, _PATCHED, False):
        return
    choose_strategy, init_strategy = cls._choose_strategy, cls._init_strategy
    ddp_class = _ddp_class(strategies.DDPStrategy)
    ddp_class.__module__, ddp_class.__qualname__ = __name__, "NeuronDDPStrategy"

    def for_neuron(self) -> bool:
        return isinstance(getattr(self, "accelerator", None), accelerator_class)

    def _choose_strategy(self):
        if for_neuron(self) and self._num_nodes_flag == 1 and len(self._parallel_devices) <= 1:
            return strategies.SingleDeviceStrategy(device=self._parallel_devices[0])
        return choose_strategy(self)

    def _init_strategy(self):
        init_strategy(self)
        if for_neuron(self) and type(self.strategy) is strategies.DDPStrategy:
            self.strategy.__class__ = ddp_class  # a subclass adding methods only

    cls._choose_strategy, cls._init_strategy = _choose_strategy, _init_strategy
    setattr(cls, _PATCHED, True)


def register(package: str) -> None:
    """Make `accelerator="neuron"` known to the Lightning package `package` (`lightning.pytorch`
    or `pytorch_lightning`), once."""
    accelerators = importlib.import_module(f"{package}.accelerators")
    registry = accelerators.AcceleratorRegistry
    if package in CLASSES or NAME in registry:  # ours already, or the user's own: kept
        return
    accelerator_class = _accelerator_class(accelerators.Accelerator)
    accelerator_class.__module__ = __name__
    accelerator_class.__qualname__ = "NeuronAccelerator"
    accelerator_class.register_accelerators(registry)
    _extend_connector(package, accelerator_class)
    CLASSES[package] = accelerator_class
