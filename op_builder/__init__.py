"""DeepSpeed op builders of the ds-mtraining sparse attention kernels.

Installed as ``ds_mtraining_op_builder`` (from the repository's ``op_builder/`` folder; see
setup.py), so it never shadows DeepSpeed's own ``op_builder``. Like DeepSpeed's builders:
``MTrainingCPUBuilder().load()`` returns the compiled module, prebuilt by
``DS_BUILD_MTRAINING=1 pip install --no-build-isolation .`` or else JIT-compiled from ``csrc/``.
(This package deliberately has no ``__deepspeed__`` marker, so DeepSpeed keeps using its own
builders.)
"""
from .cpu import MTrainingCPUBuilder
from .cuda import MTrainingCUDABuilder
from .mtraining import BUILD_VAR, NO_JIT_VAR, MTrainingBuilderMixin, csrc_root, extension_root

ALL_BUILDERS = (MTrainingCPUBuilder, MTrainingCUDABuilder)


def builder_for_device(device_type: str):
    """The builder class of the op that runs on tensors of ``device_type`` ("cpu", "cuda")."""
    for builder in ALL_BUILDERS:
        if builder.DEVICE_TYPE == device_type:
            return builder
    raise ValueError(
        f"ds-mtraining has no sparse attention op for device type '{device_type}'; supported: "
        f"{', '.join(b.DEVICE_TYPE for b in ALL_BUILDERS)}")


__all__ = ["ALL_BUILDERS", "BUILD_VAR", "NO_JIT_VAR", "MTrainingBuilderMixin", "MTrainingCPUBuilder",
           "MTrainingCUDABuilder", "builder_for_device", "csrc_root", "extension_root"]
