"""Device profiles: the published figures of the chips we emulate (see DESIGN.md).

Note [Matmul rates]: the Tensor Engine's dense rate per chip, by the dtype its operands
have (and so the dtype the roofline prices an op by):

| operands | trn2 | trn3 | source |
|---|---|---|---|
| bf16, fp16 | 667 TFLOPS | 671 | AWS's Trainium2 / Trainium3 chip figures (DESIGN.md); data path "2x128 (dense BF16/FP16 input)" (nki guides/architecture/trainium2_arch.rst:50-52, trainium3_arch.rst:47-49) |
| fp32 (and fp64, which the chip lacks) | 181 | 183 | AWS's chip figures; "roughly 4x higher" cost than BF16 per instruction (trainium_inferentia2_arch.rst:269) |
| fp8 e5m2, e4m3fn, tensorwise or rowwise scaled (`torch._scaled_mm`) | 1,299 | 1,342 | trn2: AWS's dense FP8 figure, the data path's "4x128 (dense FP8_E4/FP8_E5 input)"; trn3: plain FP8 runs at the BF16 data path ("2x128 (non-MXFP8 dense input)"), doubled by the double-row FP8 mode that v3 and v4 document ("a 256 contraction dimension takes the same amount of time as the regular BF16/FP16 ... with a 128 contraction dimension", trainium2_arch.rst:101; nki.isa.nc_matmul's perf_mode) which the emulator assumes the compiler uses: 2 x 671 |
| MXFP8 / MXFP4 (block-scaled) | - | 2,517 | AWS's Trainium3 figure; "8x128 (MXFP8 dense input)" (trainium3_arch.rst:47); torch has no MX-scaled matmul on the CPU, so only NKI's nc_matmul_mx would reach it |
| fp8 e4m3fn on trn2, the fnuz fp8 types | bf16 rate | bf16 rate (fnuz) | not formats the Tensor Engine takes: trn2 takes the IEEE-style e4m3 and e5m2, OCP e4m3fn only "Starting NeuronCore-v4" (nki.isa.nc_matmul), fnuz on neither. As TorchNeuron converts int64 to int32 with a warning, the emulator warns once and prices them as converted to bf16; the values stay CPU's (the emulator never changes what an op computes) |

Note [Collective figures]: what a collective between ranks spends (Note [Collectives on the
link] in csrc/aten/collective_pricing.cpp). Sources are in the aws-neuron-sdk repository;
`nki.collectives` are priced from the same NeuronLink, hop and reduction sources, on its DMA
engines' own figures (device/nki/costs.py).

| figure | trn2 | trn3 | source |
|---|---|---|---|
| NeuronLink per chip | 1,024 GB/s | 2,560 GB/s | trn2: "Intra-instance NeuronLink-v3 bandwidth (GB/sec/chip) 1,024" (about-neuron/arch/neuron-hardware/trn2-arch.rst); trn3: "NeuronLink-v4 ... provides 2.56 TB/sec bandwidth per device" (trainium3.rst) |
| DMA per chip | 3.5 TB/s | 4.9 TB/s | "3.5 TB/sec of DMA bandwidth" (trainium2.rst), "4.9 TB/sec of DMA bandwidth" (trainium3.rst): a rank's link rate is at most its share of these |
| reductions | 50% of DMA | 100% | "50% DMA throughput via DMA collective compute engines prior to NeuronCore-v4" (nki/guides/architecture/trainium3_arch.rst) |
| link hop | 1.5 us | 1.5 us | "the per-hop latency of Ring/KangaRing is about 1-2 us" (neuron-runtime/explore/intranode-collective-comm.rst): the midpoint, an assumption |
| scale-up domain | 16 chips | 64 chips | a trn2.48xlarge's "16 Trainium2 chips connected using ... NeuronLink-v3" (trn2-arch.rst); a Trn3 Gen1 UltraServer "integrates a total of 64 Trainium3 devices into a single scale-up domain" (trn3-arch.rst) |
| EFA per chip | 25 GB/s | 25 GB/s | trn2: a rank "gets 3.2 Tbps / 64" of a trn2.48xlarge's EFA (neuron-runtime/about/collectives.rst), 3.2 Tbps over 16 chips; trn3: none published, trn2's assumed |

A chip's link, DMA and EFA are shared by its ranks (logical NeuronCores: cores per chip / LNC),
as collectives.rst shares the EFA.
"""
from __future__ import annotations

import dataclasses

import torch

GiB = 1024**3
FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """Figures for one chip. A `neuron:N` device is a logical core: a group of NeuronCores."""

    name: str
    neuron_cores_per_chip: int
    hbm_bytes_per_chip: int
    hbm_bandwidth_bytes_per_s: float
    dense_bf16_flops: float
    fp8_flops: float  # tensorwise / rowwise scaled FP8 (Note [Matmul rates])
    fp32_flops: float
    mxfp8_flops: float | None  # block-scaled MX formats (None: the chip has no MX matmul)
    fp8_types: tuple  # the torch fp8 dtypes its Tensor Engine takes
    sram_bytes_per_core: int
    psum_bytes_per_core: int
    # The Vector Engine, which bounds the ops the Tensor Engine does not run (Note [The Vector
    # Engine floor] in device/cost.py): its clock, and the dtypes it streams 512 elements of per
    # cycle (256 of the others).
    vector_hz: float
    vector_wide_types: tuple
    # No official per-launch overhead is published. This default is our assumption: the
    # order of magnitude of a runtime kernel launch on an accelerator (10-20 us).
    launch_overhead_us: float
    # Collectives (Note [Collective figures]).
    neuronlink_bytes_per_s: float  # per chip
    dma_bytes_per_s: float  # per chip
    collective_reduce_efficiency: float  # the share of DMA throughput a reduction gets
    collective_hop_us: float
    chips_per_domain: int  # chips one scale-up domain (NeuronLink) joins
    efa_bytes_per_s_per_chip: float

    def peak_flops(self, dtype: torch.dtype) -> float:
        """Peak dense FLOP/s of one chip for matmul operands of `dtype` (Note [Matmul rates])."""
        if dtype in self.fp8_types:
            return self.fp8_flops
        if dtype in (torch.bfloat16, torch.float16) or dtype in FP8_TYPES:  # an fp8 type it lacks: converted
            return self.dense_bf16_flops
        return self.fp32_flops

    def vector_elements_per_s(self, dtype: torch.dtype) -> float:
        """Elements per second one NeuronCore's Vector Engine streams at its widest, of `dtype`."""
        return (512 if dtype in self.vector_wide_types else 256) * self.vector_hz

    def converted(self, dtype: torch.dtype) -> str | None:
        """Why a matmul on `dtype` is priced as converted, or None when the Tensor Engine takes it."""
        if dtype in FP8_TYPES and dtype not in self.fp8_types:
            return (f"the {self.name} Tensor Engine does not take {dtype} matmul operands "
                    f"(it takes {', '.join(str(t) for t in self.fp8_types)}); TorchNeuron would convert them. "
                    f"The emulator computes them as the CPU does and prices them at the bf16 rate")
        return None


PROFILES: dict[str, DeviceProfile] = {
    "trn2": DeviceProfile(
        name="trn2",
        neuron_cores_per_chip=8,
        hbm_bytes_per_chip=96 * GiB,
        hbm_bandwidth_bytes_per_s=2.9e12,
        dense_bf16_flops=667e12,
        fp8_flops=1299e12,
        fp32_flops=181e12,
        mxfp8_flops=None,
        fp8_types=(torch.float8_e5m2,),  # and the IEEE-style e4m3, which torch has no dtype for
        sram_bytes_per_core=28 * 1024**2,
        psum_bytes_per_core=2 * 1024**2,
        vector_hz=0.96e9,  # nki guides/architecture/trainium2_arch.rst:54-56, as the widths:
        vector_wide_types=(torch.bfloat16, torch.float16),  # "512 BF16/FP16 input/output; 256 ... other"
        launch_overhead_us=15.0,
        neuronlink_bytes_per_s=1024e9,
        dma_bytes_per_s=3.5e12,
        collective_reduce_efficiency=0.5,
        collective_hop_us=1.5,
        chips_per_domain=16,
        efa_bytes_per_s_per_chip=3.2e12 / 8 / 16,
    ),
    "trn3": DeviceProfile(
        name="trn3",
        neuron_cores_per_chip=8,
        hbm_bytes_per_chip=144 * GiB,
        hbm_bandwidth_bytes_per_s=4.9e12,
        dense_bf16_flops=671e12,
        fp8_flops=2 * 671e12,
        fp32_flops=183e12,
        mxfp8_flops=2517e12,
        fp8_types=(torch.float8_e4m3fn, torch.float8_e5m2),
        sram_bytes_per_core=32 * 1024**2,
        psum_bytes_per_core=2 * 1024**2,
        vector_hz=1.2e9,  # nki guides/architecture/trainium3_arch.rst:51-53, as the widths:
        vector_wide_types=(torch.bfloat16, torch.float16) + FP8_TYPES,  # "512 BF16/FP16/FP8 input/output"
        launch_overhead_us=15.0,
        neuronlink_bytes_per_s=2560e9,
        dma_bytes_per_s=4.9e12,
        collective_reduce_efficiency=1.0,
        collective_hop_us=1.5,
        chips_per_domain=64,
        efa_bytes_per_s_per_chip=3.2e12 / 8 / 16,  # trn2's (Note [Collective figures])
    ),
}
