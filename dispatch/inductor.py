"""torch.compile's default backend, inductor, on neuron tensors.

Note [Inductor on neuron]: a neuron tensor's bytes are host memory (the neuron allocator
allocates them with the CPU's allocator: csrc/runtime/memory.cpp), so inductor's CPU code generator
is the emulated device's: its C++ kernels run on the device tensors' data pointers, and its
calls to ATen kernels (extern mm, convolution) take the C++ eager path like any op. Torch
asks the PrivateUse1 device module for its code generators (`torch.neuron.Scheduling`,
`PythonWrapperCodegen`, `CppWrapperCodegen`, `WrapperFxCodegen`: all four, or torch
registers none; torch/_inductor/codegen/common.py's
init_backend_registration); they are looked up lazily (importing inductor costs seconds),
so `import torch` never pays for them.

Inductor's generated kernels read data pointers the adaptive engine knows nothing of, so a
compiled graph is a sync point, as with backend='neuron' (compile_backend.py): its call
first runs what the engine holds back (a deferred input's value is not made yet), and its own
ops bypass the engine, so that every buffer a kernel reads holds its value when the kernel runs.
The graph's ATen calls are launches as eager ops are, and so is each kernel inductor
generates: Note [Inductor kernels on the clock].
"""
from __future__ import annotations

import torch

from adaptive_eager.device import native

from .context import CONTEXT
from .dynamo_opaque import hide_late_module

_CLASSES = ("Scheduling", "PythonWrapperCodegen", "CppWrapperCodegen", "WrapperFxCodegen")


def lazy_codegen_attribute(name: str):
    """What the device module's __getattr__ returns for inductor's lookups; AttributeError
    for every other name."""
    if name not in _CLASSES:
        raise AttributeError(f"module 'torch.neuron' has no attribute {name!r}")
    _register_device_op_overrides()
    _register_device_interface()
    _schedule_as_cpu()
    if name == "Scheduling":
        return _scheduling()
    if name == "CppWrapperCodegen":
        from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

        return CppWrapperCpu
    if name == "WrapperFxCodegen":
        from torch._inductor.codegen.wrapper_fxir import WrapperFxCodegen

        return WrapperFxCodegen
    return _wrapper_codegen()


def graph_begin() -> bool:
    """At the top of a compiled graph's call: the engine's pending work runs, then the
    graph's ops bypass it. Returns the bypass setting to restore."""
    if native.projection_enabled():
        # Its generated kernels read the buffers' bytes, which projected tensors do not have.
        raise NotImplementedError(
            "torch.compile's default backend (inductor) in projection mode: its generated kernels read tensors' "
            "bytes, which tensors in adaptive_eager.projection() do not have. Compile with backend='neuron' "
            "(its graphs are projected op by op), or leave the function uncompiled while projecting.")
    native.host_sync("sync: compiled graph")
    return native.set_bypass(True)


def graph_end(previous: bool) -> None:
    native.set_bypass(previous)


def kernel_ran(*args) -> None:
    """Note [Inductor kernels on the clock]: a kernel inductor generated for neuron has run,
    called with these arguments (its buffers, and sizes). It is one launch, priced as a custom
    kernel without an estimate of its own is: by the bytes of the buffers it was given, each
    of which it reads or writes (a fused kernel's intermediates never leave it, which is what
    fusing saves). Before, the generated kernels cost nothing: a compiled graph looked as
    cheap as its matmuls alone."""
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.device.type == "neuron"]
    if tensors:
        runtime = CONTEXT.runtime
        nbytes = sum(t.nbytes for t in tensors)
        runtime.launch(tensors[0].device.index, runtime.cost.op_us(0, nbytes, tensors[0].dtype), name="inductor kernel")


def _register_device_op_overrides() -> None:
    from torch._inductor.codegen.common import device_op_overrides_dict, register_device_op_overrides
    from torch._inductor.codegen.cpu_device_op_overrides import CpuDeviceOpOverrides

    if "neuron" not in device_op_overrides_dict:
        register_device_op_overrides("neuron", CpuDeviceOpOverrides())


def _schedule_as_cpu() -> None:
    """Inductor's scheduler keeps some loop reorderings for GPUs (SIMD kernels): it skips
    them for nodes that `is_cpu()`, and applies them to any other device. Neuron's kernels
    are CPU kernels (CppScheduling), and the reindexing for a GPU's reduction groups fails
    on a CPU reduction's (TypeError in _try_reindex_pointwise_for_reduction, with dynamic
    shapes). So a neuron node is a CPU node to the scheduler: the only use of is_cpu() there
    is to keep these reorderings from CPU kernels."""
    from torch._inductor.scheduler import BaseSchedulerNode

    if getattr(BaseSchedulerNode.is_cpu, "_neuron", False):
        return

    def is_cpu(self) -> bool:
        device = self.get_device()
        return device is not None and device.type in ("cpu", "neuron")
    is_cpu._neuron = True
    BaseSchedulerNode.is_cpu = is_cpu


def _register_device_interface() -> None:
    """Dynamo's device interface: what inductor's lowerings ask of a device (its properties,
    for reductions with dynamic shapes, say). The host's, as for the code generator, with
    the device's own current device and count."""
    from torch._dynamo.device_interface import CpuInterface, get_registered_device_interfaces, \
        register_interface_for_device

    if any(name == "neuron" for name, _ in get_registered_device_interfaces()):
        return

    class NeuronInterface(CpuInterface):
        @staticmethod
        def current_device() -> int:
            return native.current_device()

        @staticmethod
        def device_count() -> int:
            import torch

            return torch.neuron.device_count()

    register_interface_for_device("neuron", NeuronInterface)


_scheduling_class = None


def _scheduling():
    """Inductor's CPU scheduling, generating its kernels as for a CPU device.

    Note [Inductor's backend for neuron]: while it generates a kernel, inductor asks which
    code generator serves the current device (torch/_inductor/utils.py get_current_backend),
    and answers `config.cuda_backend` ("triton") for every device it does not know. Neuron's
    kernels are C++ (CppScheduling), and Triton's answers were wrong for them: the dtype that
    inductor fills in for a C++ operation that sets none of its own is filled in for "cpp"
    only (codegen/common.py, CSEProxy._default), so an indexed load feeding a reduction (an
    embedding fused with a layer norm) had none and failed cpp.py's indirect_assert; and dtype
    propagation took bf16 and fp16 loads as float32, Triton's upcast. Each entry point the
    scheduler calls runs with `cuda_backend` set to "cpp" (what `cpu_backend` is for the CPU):
    neuron's code is generated as the CPU's is, and nothing outside these calls sees it."""
    global _scheduling_class
    if _scheduling_class is None:
        import functools

        import torch._inductor.config as inductor_config
        from torch._inductor.codegen.cpp import CppScheduling

        def as_cpu_backend(method):
            @functools.wraps(method)
            def generate(self, *args, **kwargs):
                with inductor_config.patch(cuda_backend="cpp"):
                    return method(self, *args, **kwargs)
            return generate

        class NeuronCppScheduling(CppScheduling):
            codegen_node = as_cpu_backend(CppScheduling.codegen_node)
            codegen_template = as_cpu_backend(CppScheduling.codegen_template)
            codegen_sync = as_cpu_backend(CppScheduling.codegen_sync)
            flush = as_cpu_backend(CppScheduling.flush)

        _scheduling_class = NeuronCppScheduling
    return _scheduling_class


_wrapper_class = None


def _wrapper_codegen():
    global _wrapper_class
    if _wrapper_class is None:
        from torch._inductor.codegen.wrapper import PythonWrapperCodegen

        class NeuronWrapperCodegen(PythonWrapperCodegen):
            """The CPU wrapper, with the graph's call bracketed by graph_begin/graph_end. (An
            exception inside the graph leaves the bypass on: later ops then run eagerly, with
            the same results.)"""

            def write_header(self):
                super().write_header()
                self.header.writeline("from adaptive_eager.dispatch import inductor as _neuron_inductor")

            def codegen_inputs(self):  # the first lines of call()
                self.prefix.writeline("_neuron_bypass = _neuron_inductor.graph_begin()")
                super().codegen_inputs()

            def _generate_kernel_call_helper(self, kernel_name, call_args, *, device=None, triton=True, **kwargs):
                # A C++ kernel on neuron is called as on the CPU: on the tensors' host bytes.
                if not triton and device is not None and device.type == "neuron":
                    self.writeline(self.wrap_kernel_call(kernel_name, call_args))
                    self.writeline(f"_neuron_inductor.kernel_ran({', '.join(call_args)})")
                    return
                super()._generate_kernel_call_helper(kernel_name, call_args, device=device, triton=triton, **kwargs)

            def generate_return(self, output_refs):
                self.wrapper_call.writeline("_neuron_inductor.graph_end(_neuron_bypass)")
                super().generate_return(output_refs)

            @staticmethod
            def create(is_subgraph, subgraph_name, parent_wrapper, partition_signatures=None):
                if is_subgraph:
                    return PythonWrapperCodegen.create(is_subgraph, subgraph_name, parent_wrapper,
                                                       partition_signatures)
                return NeuronWrapperCodegen()

        _wrapper_class = NeuronWrapperCodegen
    return _wrapper_class


# Imported lazily, after `import adaptive_eager` marked the rest: Note [Opaque to Dynamo].
hide_late_module(__name__)
