"""Building an engine: ONNX in, a stored TensorRT plan and its manifest out.

builder (the build step by step), compat (does the stored engine still fit?), int8 and calibrator
(calibrated INT8 on weakly typed TensorRT), quantize (Q/DQ ONNX for strongly typed TensorRT), islands (the
FP32 tail every precision route keeps), layer_info and layer_precision (what the engine is made of, which
layers stay out of INT8).

Nothing is re-exported here: import the module that holds a name (engines.manifest reads layer_info, which
must not pull in the builder).
"""
