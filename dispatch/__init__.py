"""The bridge between PyTorch and the emulated device: registration, NeuronTensor,
op classification, the Executor interface and the eager executor."""
from .classify import OpInfo, classify
from .context import CONTEXT, install_executor
from .executor import EagerExecutor, Executor
from .registration import register
from .tensor import NeuronTensor

__all__ = ["CONTEXT", "EagerExecutor", "Executor", "NeuronTensor", "OpInfo", "classify",
           "install_executor", "register"]
