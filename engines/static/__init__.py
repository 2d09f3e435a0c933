"""Passes of fixed shape that a CUDA graph can capture, and the speculative loop that runs on them.

On a GPU a small model's pass is paced by Python and kernel launches, not by the GPU (a 1-token pass of
the bench pair's 316M target: 36 ms, the GPU busy about 3 of them). Here every pass of a batch has one
shape per (batch size, query length): the cache buffers are allocated once for the longest request
(`cache.StaticCache`, each row written at its own end), positions, masks and write offsets are device
tensors, nothing inside a pass reads a tensor on the host, and a speculative step reads the host once,
for its accepted counts (`loop`). `capture.PassRunner` records each (batch, query length) pass as a CUDA
graph on the first call and replays it; on the CPU it calls the same pass eagerly, so CI runs the exact
code the graph replays. Dense models only (every layer full attention, no experts); the engines keep
their own path for the others.
"""
