"""What computes: backends (torch, ONNX Runtime), the dynamic batcher, inference processes, the
model repository, per-model statistics and the ONNX export."""
