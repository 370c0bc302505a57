"""What the graph-runtime backends (ONNX Runtime, TensorRT) share: the ONNX export of the model with KV-cache inputs
and outputs, its on-disk cache, and the gather/scatter that feeds the graph from the engine's paged cache."""
