"""The numerical kernels of the engine and the trainer, one module pair per operation.

Each Triton kernel replaces a short chain of torch ops whose launches and memory passes dominate a
decode step at a few hundred rows (or a pass over a large activation in training); in batch-invariant
mode (rl/model/invariant.py) the engine and the trainer run the same kernels so a token's bits do not depend
on its batch.

`<op>.py` holds the operation's torch reference (plain torch, importable without Triton: the CPU
engine and the trainer run it, and it defines what the kernel computes); `<op>_triton.py` holds its
Triton kernels, imported on first use: on CUDA, in batch-invariant mode, and by the tests, which on a
machine without a GPU run them through Triton's interpreter (chosen when a kernel is decorated, at
import). Where the torch form belongs to the caller's own algorithm it stays there and the kernel
module names it: `F.linear` for `linear_triton`, the engine's sampler and step bookkeeping
(rl/rollout/native.py) for `sampling_triton` and `advance_triton`, `rl.train.step.TokenLogprobs` for
`logprobs_triton`.
"""
