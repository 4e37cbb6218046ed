"""ldformat benchmark suite: ``python -m benchmarks.run [--quick] [--out benchmarks/results]``.

Measures, in one process, the performance bars' figures: training-step overhead and training-thread
stall of every capture mode against no checkpointing and against torch.save, safetensors,
torch.distributed.checkpoint.async_save and a CheckFreq-style snapshot/persist; bytes on disk;
anchor write throughput; recovery time; scaling with model size and chain length.
"""
