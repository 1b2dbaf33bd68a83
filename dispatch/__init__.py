"""The bridge between PyTorch and the emulated device: registration, op classification,
op records, and the Executor interface the engine implements."""
from .classify import OpInfo, classify
from .context import CONTEXT, install_executor
from .executor import EagerExecutor, Executor
from .registration import register

__all__ = ["CONTEXT", "EagerExecutor", "Executor", "OpInfo", "classify", "install_executor", "register"]
