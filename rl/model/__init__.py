"""The model, shared by the trainer and the native engine: its shape, the decoder's kernels, MoE, FP8, RoPE."""
