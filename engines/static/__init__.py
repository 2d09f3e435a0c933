"""The fixed-shape engine (`fixedshape`, `engine.FixedShapeEngine`): speculative decoding on passes of
fixed shape that a CUDA graph can capture.

On a GPU a small model's pass is paced by Python and kernel launches, not by the GPU (a 1-token pass of
the bench pair's 316M target: 36 ms, the GPU busy about 3 of them). Here every pass of a batch has one
shape per (batch size, query length, length bucket): the cache buffers are allocated once per (batch,
bucket) for the engine's lifetime (`cache.StaticCache`, each row written at its own end), positions, masks
and write offsets are device tensors, nothing inside a pass reads a tensor on the host, and a speculative
step reads the host once, for its verdict (`loop`). `capture.PassRunner` prepares each pass shape once
(a CUDA graph on a GPU, the same pass called eagerly on the CPU, the twin CI runs) and replays it.
Dense models only (every layer full attention, no experts). EQSPEC, EXSPEC, INPLACE, `batched` and the
reference never run this code: each engine name runs its own algorithm on every device.
"""
