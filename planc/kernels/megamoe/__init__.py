"""Mega MoE kernels: FP8/FP4 quantization (`quant`), the pure-PyTorch reference (`reference`), the shared buffer
cache (`buffers`), the DeepGEMM binding (`deep_gemm`) and the Triton/Gluon kernels (`triton`). See docs/megamoe.md."""
