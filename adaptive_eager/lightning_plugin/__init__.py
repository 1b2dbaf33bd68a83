"""PyTorch Lightning on neuron: `Trainer(accelerator="neuron", devices=N)` (accelerator.py),
registered with Lightning's registry as soon as Lightning is imported (import_hook.py)."""
from __future__ import annotations

from .accelerator import CLASSES, NAME, register
from .import_hook import when_imported

PACKAGES = ("lightning.pytorch", "pytorch_lightning")
# Watched in each package: its Trainer's module, the last to need the registry, the connector
# and the strategies, all imported by then. Not the package itself: `import pytorch_lightning`
# imports torch (and so this package) while it is still initializing, too late to be watched.
_TRAINER_MODULE = "{}.trainer.trainer"


def install() -> None:
    """Register neuron with each Lightning package now or when it is first imported."""
    for package in PACKAGES:
        when_imported(_TRAINER_MODULE.format(package), lambda module, package=package: register(package))


def accelerator_class(package: str = "lightning.pytorch") -> type:
    """The NeuronAccelerator class of a Lightning package (importing and registering it), for
    code that passes an instance: `Trainer(accelerator=accelerator_class()())`."""
    import importlib

    importlib.import_module(_TRAINER_MODULE.format(package))
    register(package)
    if package not in CLASSES:
        raise RuntimeError(f"{package} already has an accelerator named {NAME!r} that is not adaptive-eager's.")
    return CLASSES[package]


__all__ = ["NAME", "accelerator_class", "install"]
