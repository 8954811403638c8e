"""The quantization tool (`aieng quantize`): calibrates and quantizes a checkpoint and writes it in
the compressed-tensors format. The quantized-linear methods the runner uses live in
`aieng.quantization`."""
