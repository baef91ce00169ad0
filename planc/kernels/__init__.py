"""GPU kernels as a library: functions over local tensors (and a process group where they exchange), with no
knowledge of plans, models or modules. The runtime binds them to modules (`planc.runtime.megamoe`)."""
